"""SelectPages: the reference against the rule written out in Python, its properties, and the
ONNX node (the step graph's selection) against the reference, ties included."""

import pytest
import torch
from op_impls import check_node, run_onnx

from tieredkv.plugins.inputs import select_pages_inputs
from tieredkv.plugins.select_pages import ATTEND_ALL, select_pages

BUDGETS = ["random", "all", "tight"]


def rule(score, valid, pinned, attend) -> list[set[int]]:
    """The selection of each row in plain Python: T0, then candidates by (score desc, column asc)."""
    out = []
    for s, v, p, a in zip(score.tolist(), valid.tolist(), pinned.tolist(), attend.tolist()):
        cols = [m for m in range(len(s)) if v[m]]
        if a >= len(cols):
            out.append(set(cols))
            continue
        t0 = {m for m in cols if p[m]}
        ranked = sorted((m for m in cols if not p[m]), key=lambda m: (-s[m], m))
        out.append(t0 | set(ranked[: max(0, a - len(t0))]))
    return out


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("B,M", [(1, 1), (3, 7), (2, 40), (4, 129)])
def test_reference_is_the_rule(B, M, ties, budget):
    inputs = select_pages_inputs(torch.Generator().manual_seed(B * M + ties), B=B, M=M, ties=ties, budget=budget)
    got = select_pages(**inputs)
    assert [set(row.nonzero().flatten().tolist()) for row in got] == rule(*inputs.values())
    valid, pinned, attend = inputs["valid"], inputs["pinned"], inputs["attend_pages"]
    assert not (got & ~valid).any()  # never a padding column
    assert (got | ~(pinned & valid)).all()  # T0 always
    n_t0, n_valid = (pinned & valid).sum(-1), valid.sum(-1)
    assert torch.equal(got.sum(-1), torch.minimum(n_valid, torch.maximum(n_t0, attend)))


def test_no_budget_selects_every_page():
    inputs = select_pages_inputs(torch.Generator().manual_seed(0), B=2, M=9, budget="all")
    assert torch.equal(select_pages(**inputs), inputs["valid"])
    assert int(inputs["attend_pages"][0]) == ATTEND_ALL


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("B,M", [(1, 1), (3, 7), (2, 40), (4, 129)])
def test_onnx_matches_reference(B, M, ties, budget):
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import select_pages_model

    inputs = select_pages_inputs(torch.Generator().manual_seed(B * M + 7 * ties), B=B, M=M, ties=ties, budget=budget)
    got = run_onnx(select_pages_model(), inputs)["selected"]
    assert torch.equal(got, select_pages(**inputs))


def test_onnx_node_form():
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import SELECT_PAGES, select_pages_model

    node = check_node(select_pages_model(), SELECT_PAGES)
    assert not node.attribute  # no plugin: TensorRT inlines the body

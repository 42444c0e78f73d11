"""Writing a Triton model repository that serves tieredkv (Python backend, decoupled).

::

    <output>/<model_name>/config.pbtxt        backend python, decoupled, KIND_CPU x 1 (the engine batches)
    <output>/<model_name>/1/model.py          runtime/serving/triton/model.py, copied
    <output>/<model_name>/1/engine_args.json  the EngineArgs (model path made absolute)

The layout and the inputs/outputs are Triton's vLLM backend's (``model.json`` there,
``engine_args.json`` here). The model directory is written into a temporary directory beside
it and renamed into place: a repository never holds a half-written model.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from tieredkv.errors import ConfigError, DataFileError, short
from tieredkv.lifecycle import signals_deferred
from tieredkv.runtime.serving.deploy import ENGINE_ARGS_FILE, EngineArgs
from tieredkv.runtime.serving.triton.protocol import INPUTS, ON_CANCEL, OUTPUTS

MODEL_FILE = "model.py"
VERSION = "1"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def config_pbtxt(model_name: str, *, on_cancel: str = "free") -> str:
    """The model's config.pbtxt."""
    def dims(d: list[int]) -> str:
        return "[ " + ", ".join(str(x) for x in d) + " ]"

    ins = ",\n".join(f'  {{\n    name: "{n}"\n    data_type: {t}\n    dims: {dims(d)}\n'
                     + ("    optional: true\n" if opt else "") + "  }" for n, t, d, opt, _ in INPUTS)
    outs = ",\n".join(f'  {{\n    name: "{n}"\n    data_type: {t}\n    dims: {dims(d)}\n  }}'
                      for n, t, d, _ in OUTPUTS)
    return f"""# Written by `tieredkv triton-repo`. The engine (continuous batching over the tiered KV cache)
# batches requests itself: Triton hands them over one by one (max_batch_size 0) to one instance.
name: "{model_name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{
  decoupled: true
}}
input [
{ins}
]
output [
{outs}
]
instance_group [
  {{
    count: 1
    kind: KIND_CPU
  }}
]
parameters {{
  key: "on_cancel"
  value: {{ string_value: "{on_cancel}" }}
}}
"""


def absolute_engine_args(args: EngineArgs, base: Path | None = None) -> EngineArgs:
    """``args`` with its model, engine directory, KV settings file and disk tier directory as
    absolute paths (the server runs from another directory), the first three checked to exist;
    a model *name* stays a name."""
    from tieredkv.models.hub import MODELS, resolve_model

    base = Path.cwd() if base is None else base
    changes = {}

    def absolute(value: str) -> str:
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else (base / p).resolve())

    if args.model is not None and args.model not in MODELS:
        p = Path(absolute(args.model))
        if not p.exists():
            resolve_model(str(p))  # the typed error for a missing file
        changes["model"] = str(p)
    if args.engine is not None:
        p = Path(absolute(args.engine))
        if not p.is_dir():
            raise DataFileError(f"engine directory {args.engine!r} ({p}) not found")
        changes["engine"] = str(p)
    if args.kv and isinstance(args.kv.get("disk_path"), str):  # the disk tier's directory
        changes["kv"] = {**args.kv, "disk_path": absolute(args.kv["disk_path"])}
    if args.kv_config is not None:
        p = Path(absolute(args.kv_config))
        if not p.is_file():
            raise DataFileError(f"KV settings file {args.kv_config!r} ({p}) not found")
        changes["kv_config"] = str(p)
    return replace(args, **changes) if changes else args


def validate_engine_args(args: EngineArgs) -> None:
    """The checks a server would hit at load that need no model: the KV settings, the scheduler
    and the remote tier's settings (typed errors)."""
    from tieredkv.runtime.serving.deploy import resolve_kv_config

    args.scheduler_config()
    kv = resolve_kv_config(settings_file=args.kv_config, settings=args.kv, page_size=args.page_size)
    if args.remote is not None:
        from tieredkv.runtime.serving.remote import RemoteConfig

        RemoteConfig.from_dict(args.remote)
        if kv is None and args.engine is None:
            raise ConfigError("the remote KV tier holds prefix pages of the tiered cache; give tiered KV settings "
                              "(e.g. --kv-budget) with it")
        if args.prefix == "off":
            raise ConfigError("the remote KV tier shares prefix pages; it needs prefix reuse (prefix != off)")


def write_repository(output: str | Path, engine_args: EngineArgs, *, model_name: str = "tieredkv",
                     on_cancel: str = "free", force: bool = False) -> Path:
    """Write (or, with ``force``, replace) ``<output>/<model_name>``; returns the repository
    directory ``output``. ``on_cancel``: a cancelled request's pages are freed (``free``) or its
    full pages kept in the prefix index (``keep``)."""
    if not isinstance(model_name, str) or not _NAME.match(model_name):
        raise ConfigError(f"model name must be letters, digits, '_', '.', '-' (not starting with '.' or '-'), got "
                          f"{short(model_name)}")
    if on_cancel not in ON_CANCEL:
        raise ConfigError(f"on_cancel must be one of {list(ON_CANCEL)}, got {short(on_cancel)}")
    if not isinstance(engine_args, EngineArgs):
        raise ConfigError(f"engine_args must be an EngineArgs, got {short(engine_args)}")
    args = absolute_engine_args(engine_args)
    validate_engine_args(args)
    repo = Path(output).expanduser().resolve()
    target = repo / model_name
    if (target.exists() or target.is_symlink()) and not force:
        raise ConfigError(f"{target} exists; pass --force (force=True) to replace that model")
    try:
        repo.mkdir(parents=True, exist_ok=True)
        source = Path(__file__).with_name(MODEL_FILE)
        with tempfile.TemporaryDirectory(dir=repo, prefix=f".{model_name}.") as tmp:
            staged = Path(tmp) / model_name
            version = staged / VERSION
            version.mkdir(parents=True)
            (staged / "config.pbtxt").write_text(config_pbtxt(model_name, on_cancel=on_cancel), encoding="utf-8")
            shutil.copyfile(source, version / MODEL_FILE)
            args.save(version / ENGINE_ARGS_FILE)
            with signals_deferred():  # the two renames are never split by a signal
                if target.exists() or target.is_symlink():
                    os.replace(target, Path(tmp) / "replaced")  # removed with the temporary directory
                os.replace(staged, target)
    except OSError as exc:
        raise DataFileError(f"{target}: cannot write the model repository ({exc.strerror or exc})") from None
    return repo

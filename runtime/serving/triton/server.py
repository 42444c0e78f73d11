"""Getting and running a real Triton Inference Server on a machine without NVIDIA's container.

NVIDIA ships ``tritonserver`` inside its containers (``nvcr.io/nvidia/tritonserver:<yy.mm>-py3``);
on a GPU machine use that. Elsewhere — CI, a laptop, this project's tests — the PyPI wheel
``nvidia-pytriton==0.7.0`` carries a complete ``tritonserver`` 2.51 (the server, the Python
backend, a Python backend stub per Python version and the shared libraries they link). pytriton
itself pins ``numpy<2`` and would fight this project's dependencies, so it is never installed:
:func:`pull_tritonserver` runs ``pip download --no-deps`` and extracts only the server and its
libraries into the tieredkv cache (``$TIEREDKV_CACHE`` or ``~/.cache/tieredkv``)::

    <cache>/tritonserver/2.51/
        pytriton/tritonserver/bin/tritonserver
        pytriton/tritonserver/backends/python/        libtriton_python.so, triton_python_backend_utils.py
        pytriton/tritonserver/backends-py3.X/python/  the same plus triton_python_backend_stub for Python 3.X
        pytriton/tritonserver/caches/local/
        nvidia_pytriton.libs/                         the libraries the binaries' RPATH points at

The Python backend runs each model instance in a *stub* process that embeds libpython of one
Python version; the wheel has one stub per version and the backend looks for
``<backend dir>/python/triton_python_backend_stub``, so the pull builds one backend directory per
Python version (hard links, no extra space) and :class:`TritonServer` points
``--backend-directory`` at the one of the running Python (as pytriton does with a per-run copy).

What the stub needs from its environment (:func:`server_environment`):

- ``LD_LIBRARY_PATH`` with the running Python's ``LIBDIR`` first, so the stub loads *this*
  libpython3.X (another build of the same version fails in ``threading`` with
  ``'_thread.RLock' object has no attribute '_recursion_count'``), then ``nvidia_pytriton.libs``;
- ``PATH`` with a ``bin/python3`` first: the stub's embedded interpreter runs *isolated*
  (``PYTHONPATH`` and the other ``PYTHON*`` variables are ignored) and finds its prefix by looking
  up ``python3`` on PATH, so a virtual environment's ``bin`` makes the stub run inside that
  environment (its site-packages, ``tieredkv`` included) — pytriton's trick too;
- NumPy 1.x: the 2.51 stub was built against NumPy 1 and misreads NumPy 2 arrays (a string
  tensor arrives as garbage and the stub aborts in ``deserialize_bytes_tensor``). When the running
  environment has NumPy 2, :class:`TritonServer` gives the stub a small prefix of its own
  (:func:`stub_prefix`: ``pyvenv.cfg``, ``bin/python3``, and ``.pth`` files that put
  ``numpy==1.26.4`` — installed once with ``pip install --target`` into the cache — ahead of the
  running environment's site-packages). tieredkv runs on NumPy 1.26 as on 2.x.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tieredkv.errors import DownloadError, TieredKVError
from tieredkv.lifecycle import signals_deferred

TRITON_VERSION = "2.51"
PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
#: the environment variable naming a tritonserver binary to use instead of the pulled one
TRITONSERVER_ENV = "TRITONSERVER"
_MEMBERS = ("pytriton/tritonserver/", "nvidia_pytriton.libs/")
#: the NumPy the 2.51 Python backend stub works with (module docstring)
STUB_NUMPY = "numpy==1.26.4"


class TritonServerNotFoundError(TieredKVError):
    """No tritonserver binary: not pulled, and ``$TRITONSERVER`` unset or wrong."""


class TritonServerError(TieredKVError):
    """The server did not start, did not become ready in time, or stopped unexpectedly."""


def python_tag() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def tritonserver_root() -> Path:
    """Where :func:`pull_tritonserver` puts the server (it may not exist yet)."""
    from tieredkv.models.hub import cache_dir

    return cache_dir() / "tritonserver" / TRITON_VERSION


def _binary(root: Path) -> Path:
    return root / "pytriton" / "tritonserver" / "bin" / "tritonserver"


def _extract(wheel: Path, dest: Path) -> None:
    """The server part of the pytriton wheel into ``dest`` (executable bits restored: zip
    entries carry the Unix mode in their high 16 bits), plus one backend directory per stub."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(_MEMBERS) and not n.endswith("/")]
        if not any(n.endswith("bin/tritonserver") for n in names):
            raise DownloadError(f"{wheel.name} does not contain pytriton/tritonserver/bin/tritonserver")
        for name in names:
            target = dest / name
            if ".." in Path(name).parts:
                raise DownloadError(f"{wheel.name}: unexpected member path {name!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            # never the archive's group/other write bits; executables (by mode or by kind) 0o755
            executable = (zf.getinfo(name).external_attr >> 16) & 0o111 or ".so" in Path(name).name \
                or name.endswith(("/tritonserver", "/triton_python_backend_stub"))
            os.chmod(target, 0o755 if executable else 0o644)
    server = dest / "pytriton" / "tritonserver"
    for stub in sorted((server / "python_backend_stubs").glob("*/triton_python_backend_stub")):
        backend = server / f"backends-py{stub.parent.name}" / "python"
        backend.mkdir(parents=True)
        for f in (server / "backends" / "python").iterdir():
            _link_or_copy(f, backend / f.name)
        _link_or_copy(stub, backend / "triton_python_backend_stub")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def pull_tritonserver(*, force: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Make tritonserver 2.51 present in the tieredkv cache; returns the binary's path.

    ``pip download --no-deps nvidia-pytriton==0.7.0`` (55 MB), then only ``pytriton/tritonserver/``
    and ``nvidia_pytriton.libs/`` from the wheel are extracted, into a temporary directory renamed
    into place at the end: a cache never holds a half-written server. ``force`` replaces a
    present one."""
    from tieredkv.models.hub import cache_access, download_wheel

    root = tritonserver_root()
    with cache_access():
        if _binary(root).is_file() and not force:
            if needs_stub_numpy():
                stub_numpy_dir(log=log)
            return _binary(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        if log:
            log(f"pulling tritonserver {TRITON_VERSION} ({PYTRITON_REQUIREMENT} from PyPI, the server only, "
                f"no Python dependencies) into {root} ...")
        with tempfile.TemporaryDirectory(dir=root.parent, prefix=".pull-") as tmp:
            tmpdir = Path(tmp)
            wheel = download_wheel(PYTRITON_REQUIREMENT, tmpdir / "wheel")
            staged = tmpdir / "server"
            _extract(wheel, staged)
            wheel.unlink()
            with signals_deferred():  # the two renames are never split by a signal
                if root.exists() and force:
                    os.replace(root, tmpdir / "old")  # removed with the temporary directory
                try:
                    os.replace(staged, root)
                except OSError:
                    if not _binary(root).is_file():  # not another pull that finished first
                        raise
        if needs_stub_numpy():
            stub_numpy_dir(log=log)
    if log:
        log(f"tritonserver ready: {_binary(root)}")
    return _binary(root)


def needs_stub_numpy() -> bool:
    """Whether the running environment's NumPy is 2.x (the pulled stub needs 1.x)."""
    try:
        import numpy
    except ImportError:
        return False
    return int(numpy.__version__.split(".")[0]) >= 2


def stub_numpy_dir(*, log: Callable[[str], None] | None = None) -> Path:
    """``numpy==1.26.4`` for the running Python version, installed once (``pip install --no-deps
    --target``, atomically) under the pulled server; returns the directory to put on sys.path."""
    from tieredkv.models.hub import cache_access

    target = tritonserver_root() / "stub-numpy" / f"py{python_tag()}"
    with cache_access():
        if (target / "numpy" / "__init__.py").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        if log:
            log(f"installing {STUB_NUMPY} for the Python backend stub into {target} ...")
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
            staged = Path(tmp) / "site"
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                   "-q", "--target", str(staged), STUB_NUMPY]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not (staged / "numpy" / "__init__.py").is_file():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise DownloadError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): {' | '.join(tail)}")
            try:
                os.replace(staged, target)
            except OSError:
                if not (target / "numpy" / "__init__.py").is_file():  # not another install that finished first
                    raise
    return target


def stub_prefix(dest: str | Path, *, numpy_dir: str | Path | None = None) -> Path:
    """A virtual-environment-like prefix for the Python backend stub at ``dest``: ``bin/python3``
    (a link to the base interpreter), ``pyvenv.cfg``, and a site-packages whose ``.pth`` files
    put ``numpy_dir`` first, then add the running environment's site directories (their own
    ``.pth`` files, editable installs included, are processed). Put ``dest/bin`` first on PATH."""
    import site

    dest = Path(dest)
    base = Path(getattr(sys, "_base_executable", "") or sys.executable).resolve()
    ver = python_tag()
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    for name in ("python3", "python", f"python{ver}"):
        link = dest / "bin" / name
        if not link.exists():
            link.symlink_to(base)
    (dest / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                     f"version = {sys.version.split()[0]}\n", encoding="utf-8")
    sp = dest / "lib" / f"python{ver}" / "site-packages"
    sp.mkdir(parents=True, exist_ok=True)
    if numpy_dir is not None:
        (sp / "a_tieredkv_stub_numpy.pth").write_text(f"{Path(numpy_dir)}\n", encoding="utf-8")
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs)
    (sp / "b_tieredkv_stub_site.pth").write_text(lines, encoding="utf-8")
    return dest


def find_tritonserver() -> Path:
    """The tritonserver binary: ``$TRITONSERVER`` when set, else the pulled one."""
    env = os.environ.get(TRITONSERVER_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file() or not os.access(p, os.X_OK):
            raise TritonServerNotFoundError(f"${TRITONSERVER_ENV}={env}: not an executable file; point it at a "
                                            "tritonserver binary (NVIDIA's container: /opt/tritonserver/bin/tritonserver)")
        return p
    p = _binary(tritonserver_root())
    if p.is_file():
        return p
    raise TritonServerNotFoundError(
        f"no tritonserver: run `tieredkv triton-server pull` (downloads {PYTRITON_REQUIREMENT} from PyPI and extracts "
        f"the server into {tritonserver_root()}), or set ${TRITONSERVER_ENV} to a tritonserver binary (on a GPU "
        "machine: NVIDIA's container nvcr.io/nvidia/tritonserver:<yy.mm>-py3, /opt/tritonserver/bin/tritonserver)")


def backend_directory(binary: Path) -> Path:
    """The ``--backend-directory`` for ``binary``: the pulled layout's per-Python-version one, or
    the ``backends`` directory beside ``bin`` (NVIDIA's layout: /opt/tritonserver/backends)."""
    home = Path(binary).resolve().parent.parent
    versioned = home / f"backends-py{python_tag()}"
    if versioned.is_dir():
        return versioned
    if (home / "python_backend_stubs").is_dir():
        have = sorted(p.name for p in (home / "python_backend_stubs").iterdir())
        raise TritonServerError(f"{home}: no Python backend stub for Python {python_tag()} (it has {have}); "
                                "run the server with one of those Python versions")
    return home / "backends"


def server_environment(binary: Path, base: dict[str, str] | None = None, *,
                       python_bin: str | Path | None = None) -> dict[str, str]:
    """The environment the server and its Python backend stubs need (module docstring);
    ``python_bin``: the directory of the ``python3`` the stubs use (default: the running one's)."""
    env = dict(os.environ if base is None else base)
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    pulled_libs = Path(binary).resolve().parent.parent.parent.parent / "nvidia_pytriton.libs"
    if pulled_libs.is_dir():
        libs.append(str(pulled_libs))
    libs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(p for p in libs if p))
    # not resolved: a venv's bin, whose python3 has pyvenv.cfg one level up
    bindir = str(python_bin) if python_bin is not None else str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(dict.fromkeys([bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p]))
    return env


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now (the kernel's choice; a small race remains)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class TritonServer:
    """A tritonserver process, for tests, examples and local use.

    ``with TritonServer(repo) as server: ...`` starts it (HTTP, gRPC and metrics on ``host``,
    127.0.0.1 by default, each on the given port or a free one), waits until
    ``/v2/health/ready`` answers 200, and stops it on exit (SIGTERM to its pid — Triton unloads
    its models and exits —, SIGKILL to its process group after ``stop_timeout``). The log
    (stdout and stderr) goes to ``log_file`` (default: a file in the server's temporary
    directory; :meth:`log_text`). ``model_control_mode``: ``none`` loads every model of the
    repository at start (one that fails to load fails the start: TritonServerError with the
    log's tail), ``explicit`` loads ``load_models`` at start and the others through the client
    API (``client.load_model``). ``stub_numpy``: give the Python backend stub NumPy 1.x (module
    docstring; None: when the running NumPy is 2.x and the server is the pulled one).
    ``extra_args`` are passed on as given."""

    def __init__(self, model_repository: str | Path | Sequence[str | Path], *, binary: str | Path | None = None,
                 backend_dir: str | Path | None = None, log_file: str | Path | None = None,
                 host: str = "127.0.0.1", http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, model_control_mode: str = "none", load_models: Iterable[str] = (),
                 log_verbose: int = 0, exit_timeout: int = 10, stub_timeout: int = 120,
                 startup_timeout: float = 180.0, stop_timeout: float = 30.0, stub_numpy: bool | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None):
        repos = [model_repository] if isinstance(model_repository, (str, Path)) else list(model_repository)
        self.repositories = [Path(r).expanduser().resolve() for r in repos]
        for r in self.repositories:
            if not r.is_dir():
                raise TritonServerError(f"model repository {r} is not a directory")
        self.binary = Path(binary) if binary is not None else find_tritonserver()
        self.backend_dir = Path(backend_dir) if backend_dir is not None else backend_directory(self.binary)
        if stub_numpy is None:
            pulled = tritonserver_root().resolve() in self.binary.resolve().parents
            stub_numpy = pulled and needs_stub_numpy()
        self.stub_numpy = stub_numpy
        self.host, self.ports = host, (http_port, grpc_port, metrics_port)
        self.model_control_mode, self.load_models = model_control_mode, list(load_models)
        self.log_verbose, self.exit_timeout, self.stub_timeout = log_verbose, exit_timeout, stub_timeout
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.extra_args, self.base_env = list(extra_args), env
        self.log_file = Path(log_file) if log_file is not None else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0

    # ------------------------------------------------------------------ addresses
    @property
    def http_url(self) -> str:
        """``host:port`` (tritonclient's form; prefix ``http://`` for other clients)."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # ------------------------------------------------------------------ process
    def command(self) -> list[str]:
        cmd = [str(self.binary)]
        cmd += [f"--model-repository={r}" for r in self.repositories]
        cmd += [f"--backend-directory={self.backend_dir}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true", "--allow-gpu-metrics=false",
                f"--model-control-mode={self.model_control_mode}",
                f"--exit-timeout-secs={self.exit_timeout}",
                f"--log-verbose={self.log_verbose}",
                # a prefix of its own: two servers on one machine never share a shared-memory region name
                f"--backend-config=python,shm-region-prefix-name=tieredkv{os.getpid()}-{secrets.token_hex(4)}",
                f"--backend-config=python,stub-timeout-seconds={self.stub_timeout}"]
        caches = self.binary.resolve().parent.parent / "caches"
        if caches.is_dir():
            cmd.append(f"--cache-directory={caches}")
        cmd += [f"--load-model={m}" for m in self.load_models]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        python_bin = None
        if self.stub_numpy:
            prefix = stub_prefix(Path(self._tmp.name) / "stub-python", numpy_dir=stub_numpy_dir())
            python_bin = prefix / "bin"
        return server_environment(self.binary, self.base_env, python_bin=python_bin)

    def start(self) -> "TritonServer":
        if self.proc is not None and self.proc.poll() is None:
            raise TritonServerError(f"tritonserver already running (pid {self.proc.pid})")
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tieredkv-triton-")
        if self.log_file is None:
            self.log_file = Path(self._tmp.name) / "tritonserver.log"
        env = self.environment()
        for attempt in range(3):
            free = iter(free_ports(3, self.host))
            self.http_port, self.grpc_port, self.metrics_port = (p if p else next(free) for p in self.ports)
            self._spawn(env)
            try:
                self._wait_ready()
                return self
            except TritonServerError:
                text = self.log_text()
                retry = not all(self.ports) and ("already in use" in text or "Failed to start" in text)
                self.stop()
                if attempt == 2 or not retry:
                    raise
        return self

    def _spawn(self, env: dict[str, str]) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            # its own process group: stop() can end the server and its Python backend stubs together
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise TritonServerError(f"tritonserver exited with status {code} while starting; its log "
                                        f"({self.log_file}) ends with:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.2)
        raise TritonServerError(f"tritonserver not ready after {self.startup_timeout:.0f}s; its log ({self.log_file}) "
                                f"ends with:\n{self.log_tail()}")

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """Until the server exits (``tieredkv triton-server run``); its exit status."""
        return self.proc.wait()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL to the process group after ``stop_timeout``; the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # a stub outlives a killed server by a moment: never leave one behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode

    def close(self) -> None:
        """Stop the server and remove its temporary directory (a log file inside it too)."""
        self.stop()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "TritonServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ logs
    def log_text(self) -> str:
        try:
            return self.log_file.read_text(encoding="utf-8", errors="replace") if self.log_file else ""
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

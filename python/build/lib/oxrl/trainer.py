"""``Trainer(config).train()``: a run of the ``oxrl`` binary from Python.

The binary does the work; this module writes the configuration, starts the process (or one per
rank), forwards its progress, and turns its outcome into a return value or an exception.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

ConfigLike = Union[Mapping[str, Any], str, "os.PathLike[str]"]


class OxrlError(RuntimeError):
    """A run that failed: the binary's ``error:`` message, and its exit status."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def find_binary(binary: Optional[str] = None) -> str:
    """The ``oxrl`` executable: ``binary``, ``OXRL_BINARY``, the one a wheel carries
    (``oxrl/bin/oxrl``), ``oxrl`` on ``PATH``, or this repository's ``target/release/oxrl``."""
    here = Path(__file__).resolve().parent
    candidates = [
        binary,
        os.environ.get("OXRL_BINARY"),
        str(here / "bin" / "oxrl"),
        shutil.which("oxrl"),
        str(here.parent.parent / "target" / "release" / "oxrl"),
    ]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise OxrlError(
        "no oxrl binary: build it (`cargo build --release` in the repository), put it on PATH, "
        "or set OXRL_BINARY",
        127,
    )


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        # JSON's string escapes are TOML basic strings' too.
        return json.dumps(os.fspath(value), ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise OxrlError(f"config key {where}: {type(value).__name__} has no TOML form", 2)


def _is_table_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, Mapping) for v in value
    )


def write_toml(config: Mapping[str, Any]) -> str:
    """``config`` as TOML: scalars and lists as keys, dicts as ``[tables]``, lists of dicts as
    ``[[arrays of tables]]``."""
    lines: List[str] = []

    def bare(key: Any) -> str:
        key = str(key)
        plain = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
        return key if plain else json.dumps(key)

    def table(values: Mapping[str, Any], prefix: str) -> None:
        nested = []
        for key, value in values.items():
            where = f"{prefix}{key}"
            if isinstance(value, Mapping) or _is_table_list(value):
                nested.append((key, value))
            else:
                lines.append(f"{bare(key)} = {_toml_value(value, where)}")
        for key, value in nested:
            name = f"{prefix}{bare(key)}"
            if isinstance(value, Mapping):
                # A table holding only tables needs no header of its own.
                if any(not (isinstance(v, Mapping) or _is_table_list(v)) for v in value.values()):
                    lines.append("")
                    lines.append(f"[{name}]")
                table(value, f"{name}.")
            else:
                for item in value:
                    lines.append("")
                    lines.append(f"[[{name}]]")
                    table(item, f"{name}.")

    table(config, "")
    return "\n".join(lines).strip() + "\n"


def _absolute_paths(value: Any, key: str) -> Any:
    """Strings naming files or directories relative to the working directory become absolute
    (the binary resolves a config's paths against the config file's directory, and a dict's
    config file lives in a temporary directory)."""
    if isinstance(value, Mapping):
        return {k: _absolute_paths(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_absolute_paths(v, key) for v in value]
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if key == "output_dir" or (not os.path.isabs(text) and os.path.exists(text)):
            return os.path.abspath(text)
        return text
    return value


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class _Process:
    """One running ``oxrl`` process whose output is forwarded line by line, keeping the last
    ``error:`` line."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], prefix: str, quiet: bool):
        self.error: Optional[str] = None
        self.tail: List[str] = []
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, prefix, quiet)),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, prefix, quiet)),
        ]
        for t in self.threads:
            t.daemon = True
            t.start()

    def _pump(self, stream, sink, prefix: str, quiet: bool) -> None:
        for line in stream:
            if line.startswith("error: "):
                self.error = line[len("error: ") :].strip()
            self.tail = (self.tail + [line.rstrip("\n")])[-20:]
            if not quiet:
                sink.write(prefix + line)
                sink.flush()

    def wait(self) -> int:
        code = self.proc.wait()
        for t in self.threads:
            t.join()
        return code

    def message(self, code: int) -> str:
        if self.error:
            return self.error
        return f"oxrl exited with status {code}: " + " | ".join(self.tail[-5:])


class Trainer:
    """A training run: ``Trainer(config).train()`` returns the last step's metrics.

    ``config`` is a dict (the TOML's tables as nested dicts, ``[[reward.functions]]`` as a list
    of dicts; relative paths are relative to the working directory) or the path of a TOML file.
    ``num_workers`` (default: the config's ``num_gpus`` when above 1, else 1) is the number of
    processes; ``use_gpu`` (default: ``num_gpus > 0``) gives each a GPU. With several, the
    ``launcher`` is ``"ray"`` (one rank per bundle of a placement group, restarts from the last
    checkpoint), ``"local"`` (processes on this machine) or ``"auto"`` (Ray when a Ray cluster is
    initialised or ``RAY_ADDRESS`` is set, else local).
    """

    def __init__(
        self,
        config: ConfigLike,
        *,
        output_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        num_workers: Optional[int] = None,
        use_gpu: Optional[bool] = None,
        launcher: str = "auto",
        max_restarts: int = 2,
        cpus_per_worker: float = 1,
        binary: Optional[str] = None,
        quiet: bool = False,
    ):
        if launcher not in ("auto", "local", "ray"):
            raise OxrlError(f"launcher {launcher!r}: expected 'auto', 'local' or 'ray'", 2)
        self.binary = find_binary(binary)
        self.launcher = launcher
        self.max_restarts = max_restarts
        self.cpus_per_worker = cpus_per_worker
        self.quiet = quiet
        self._workdir = tempfile.mkdtemp(prefix="oxrl-")
        if isinstance(config, Mapping):
            values = _absolute_paths(dict(config), "")
            trainer = dict(values.get("trainer") or {})
            if output_dir is not None:
                trainer["output_dir"] = os.path.abspath(os.fspath(output_dir))
            trainer.setdefault("output_dir", os.path.abspath(os.path.join("runs", "oxrl")))
            values["trainer"] = trainer
            self.output_dir = trainer["output_dir"]
            self.config_path = os.path.join(self._workdir, "run.toml")
            with open(self.config_path, "w", encoding="utf-8") as f:
                f.write(write_toml(values))
            num_gpus = values.get("num_gpus")
        else:
            self.config_path = os.path.abspath(os.fspath(config))
            values = _read_toml(self.config_path)
            num_gpus = values.get("num_gpus")
            if output_dir is not None:
                self.output_dir = os.path.abspath(os.fspath(output_dir))
            else:
                # The binary's rule: [trainer] output_dir relative to the file, else
                # runs/<file stem> relative to the working directory.
                given = (values.get("trainer") or {}).get("output_dir")
                base = os.path.dirname(self.config_path)
                stem = Path(self.config_path).stem
                self.output_dir = os.path.normpath(
                    os.path.join(base, given) if given else os.path.abspath(os.path.join("runs", stem))
                )
        gpus = int(num_gpus) if isinstance(num_gpus, int) else 0
        self.num_workers = int(num_workers) if num_workers is not None else max(gpus, 1)
        self.use_gpu = bool(use_gpu) if use_gpu is not None else gpus > 0
        if self.num_workers < 1:
            raise OxrlError(f"num_workers = {self.num_workers}: expected at least 1", 2)

    def argv(self, resume: bool = False, max_steps: Optional[int] = None) -> List[str]:
        """The command each rank runs."""
        argv = [self.binary, "train", "--config", self.config_path, "--output-dir", self.output_dir]
        if resume:
            argv.append("--resume")
        if max_steps is not None:
            argv += ["--max-steps", str(int(max_steps))]
        return argv

    def train(self, resume: bool = False, max_steps: Optional[int] = None) -> Dict[str, float]:
        """Runs the training to its end and returns the last step's metrics; raises
        :class:`OxrlError` with the binary's message if it fails."""
        argv = self.argv(resume, max_steps)
        if self.num_workers == 1:
            self._run_local(argv, 1)
        elif self._use_ray():
            from . import ray as oxrl_ray

            oxrl_ray.run_ranks(
                argv,
                self.num_workers,
                use_gpu=self.use_gpu,
                max_restarts=self.max_restarts,
                cpus_per_worker=self.cpus_per_worker,
                quiet=self.quiet,
            )
        else:
            self._run_local(argv, self.num_workers)
        return self.final_metrics()

    def final_metrics(self) -> Dict[str, float]:
        """The last line of the run's ``metrics.jsonl``."""
        path = os.path.join(self.output_dir, "metrics.jsonl")
        try:
            with open(path, encoding="utf-8") as f:
                lines = [l for l in f if l.strip()]
        except FileNotFoundError:
            raise OxrlError(f"{path}: the run wrote no metrics", 1) from None
        if not lines:
            raise OxrlError(f"{path}: the run wrote no metrics", 1)
        return json.loads(lines[-1])

    def _use_ray(self) -> bool:
        if self.launcher != "auto":
            return self.launcher == "ray"
        if os.environ.get("RAY_ADDRESS"):
            return True
        try:
            import ray
        except ImportError:
            return False
        return ray.is_initialized()

    def _run_local(self, argv: Sequence[str], world: int) -> None:
        """``world`` processes of ``argv`` on this machine, with the variables a launcher sets;
        rank 0's output is forwarded, every rank's error is kept."""
        port = _free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ)
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(name, None)
            if world > 1:
                env.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            prefix = "" if world == 1 else f"[rank {rank}] "
            procs.append(_Process(argv, env, prefix, self.quiet or rank > 0))
        codes = [p.wait() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        if failed:
            rank, code = failed[0]
            message = procs[rank].message(code)
            if world > 1:
                message = f"rank {rank}: {message}"
            raise OxrlError(message, code)


def _read_toml(path: str) -> Dict[str, Any]:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - older Pythons
        try:
            import tomli as tomllib  # type: ignore
        except ImportError:
            return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise OxrlError(f"{path}: no such configuration file", 2) from None
    except Exception:
        # The binary reports a malformed file with its line; let it.
        return {}

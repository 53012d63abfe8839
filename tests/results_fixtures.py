"""`make results` (scripts/cpu_results.sh) at smoke length. The session fixture `cpu_results`
(conftest.py) runs it once: its demo step is the demo test's pipeline, its report the report tests'
tables."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cpu_results.sh"
SMOKE_TIMEOUT_S = 1500  # about 4 minutes on 2 shared cores


@dataclass(frozen=True)
class CpuResults:
    """Where one run of the script put its data, store and results, and what it printed."""

    base: Path
    stdout: str

    @property
    def out(self) -> Path:
        return self.base / "results"

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def demo_run(self) -> Path:
        return self.base / "store" / "gpt-demo"


def script_env(base: Path, **extra: str) -> dict[str, str]:
    """The script's environment: this interpreter's `repro`, data, store and output under `base`."""
    return {**os.environ, "REPRO": str(Path(sys.executable).with_name("repro")), "PY": sys.executable,
            "REPRO_DATA_DIR": str(base / "data"), "STORE_DIR": str(base / "store"), "OUT": str(base / "results"),
            "OMP_NUM_THREADS": "1", **extra}


def run_smoke(base: Path, mirror: Path) -> CpuResults:
    """The script's whole chain, a few iterations each, data fetched from `mirror` into `base`."""
    env = script_env(base, SMOKE="1", REPRO_DATA_MIRROR=str(mirror))
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return CpuResults(base, out.stdout)

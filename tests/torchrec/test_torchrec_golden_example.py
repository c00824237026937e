"""TorchRec's golden training script, two lines changed (examples/torchrec_golden_training.py),
under ``torchrun --nproc-per-node 2`` on CPU: see golden_example_harness.py for what is checked."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from spawning import free_port

HARNESS = pathlib.Path(__file__).with_name("golden_example_harness.py")


def test_torchrec_golden_training_script_runs_on_dynemb_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(HARNESS), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    for rank in range(2):
        assert f"golden example: rank {rank} ok" in done.stdout, done.stdout[-4000:]

"""Write the compatibility fixtures: a state_dict and a checkpoint (base + delta) of a model
holding every kind of dynemb table, and the table contents they hold.

Run once by a version whose format later versions must keep reading (the files beside this
script were written at commit 6ca4fdc, before the one-engine refactor); ``test_compat.py`` loads
them with the current code. Rewriting them defeats their purpose.

    python tests/checkpoint/compat/make_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import torch
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from ckpt_models import contents, train  # noqa: E402
from compat_model import BASE_STEPS, DELTA_STEPS, CompatModel, flat  # noqa: E402

import dynemb  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model = CompatModel()
    train(model, BASE_STEPS)
    torch.save(model.state_dict(), HERE / "state_dict.pt")
    shutil.rmtree(HERE / "ckpt", ignore_errors=True)
    dynemb.checkpoint.save(model, HERE / "ckpt" / "base")
    save_file(flat(contents(model)), HERE / "contents_base.safetensors")
    train(model, DELTA_STEPS)
    dynemb.checkpoint.save_delta(model, HERE / "ckpt" / "delta", base=HERE / "ckpt" / "base")
    save_file(flat(contents(model)), HERE / "contents_delta.safetensors")
    print(f"wrote fixtures in {HERE}")


if __name__ == "__main__":
    main()

"""SFTTrainer in float8 (torchao, emulated) as one rank of a 2-process torchrun launch, for tests/test_float8_layouts.py.

usage: torchrun --standalone --nproc_per_node 2 _float8_layout_worker.py OUTPUT_DIR LAYOUT [LAYOUT ...]
Each LAYOUT (a key of LAYOUTS) trains the tiny model with that parallelism_config and float8 recipe and writes, from
rank 0, OUTPUT_DIR/LAYOUT/log.json (the log history) and the saved model in OUTPUT_DIR/LAYOUT/.
"""

import json
import os
import sys
from pathlib import Path

from _distributed_train_worker import MODEL, PER_DEVICE, config, train_dataset
from accelerate.parallelism_config import ParallelismConfig

from hfnative import SFTTrainer
from hfnative.parallel.float8 import is_float8_linear

# name -> (ParallelismConfig sizes, float8 recipe)
LAYOUTS = {
    "fsdp2-tensorwise": (dict(dp_shard_size=2), "tensorwise"),  # weights all-gathered in float8
    "tp2-rowwise": (dict(dp_shard_size=1, tp_size=2), "rowwise"),
}


def main(output_dir: str, layouts: list[str]) -> None:
    for name in layouts:
        sizes, recipe = LAYOUTS[name]
        out = Path(output_dir) / name
        args = config(str(out), PER_DEVICE, parallelism_config=ParallelismConfig(**sizes), float8_recipe=recipe)
        trainer = SFTTrainer(model=MODEL, args=args, train_dataset=train_dataset({}))
        assert is_float8_linear(trainer.native_model.layers[0].attention.wq)
        trainer.train()
        trainer.save_model()
        if int(os.environ["RANK"]) == 0:
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""`python tests/threads_after_train.py <train.py overrides>`: train() as train.py runs it (Lightning starts the other
ranks from this script), then each rank writes the names of the threads its process still runs (Linux's
/proc/self/task/*/comm) to <output_dir>/threads/<pid>.json, for tests/test_launch.py; a run stopped by a signal
exits as train.py does (128 + the signal's number)."""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hydra  # noqa: E402

import train  # noqa: E402


@hydra.main(version_base="1.3", config_path=str(REPO / "conf"), config_name="train")
def main(cfg) -> None:
    try:
        train.train(cfg)
    except train.Preempted as err:
        print(err, file=sys.stderr)
        sys.exit(err.exit_code)
    finally:  # train() has returned or raised
        names = sorted(comm.read_text().strip() for comm in Path("/proc/self/task").glob("*/comm"))
        out = Path(cfg.output_dir) / "threads"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{os.getpid()}.json").write_text(json.dumps(names))


if __name__ == "__main__":
    main()

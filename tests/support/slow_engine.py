"""``python -m tests.support.slow_engine SECONDS GO_FILE [kaiten engine flags]``: a real engine process
whose every step lasts at least SECONDS (the tiny model finishes 200 tokens in well under a second;
tests that kill an engine mid-stream need the streams still running when the signal lands). With a
GO_FILE other than "-", the engine loads its model, then waits for that file to exist before it
joins Redis: a test decides which engine takes which requests."""
from __future__ import annotations

import os
import sys
import time


def main() -> int:
    from engine_worker import cli, worker
    from engine_worker.engine.llm_engine import LLMEngine
    pause, go_file = float(sys.argv[1]), sys.argv[2]
    step, run = LLMEngine.step, worker.EngineWorker.run

    def slow_step(self):
        time.sleep(pause)
        return step(self)

    def run_when_told(self):
        while go_file != "-" and not os.path.exists(go_file):
            time.sleep(0.02)
        return run(self)
    LLMEngine.step = slow_step
    worker.EngineWorker.run = run_when_told
    return cli.main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())

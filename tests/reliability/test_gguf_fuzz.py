"""Fuzzed GGUF files (gguf_fuzz.py): hundreds of mutations of a real file, each imported
for real, in a child process so a crash fails this test with the trial that caused it.
Every trial ends in an imported model or a GGUFImportError; nothing is left behind.

REPRISE_FUZZ_TRIALS sets the number of trials (default 400); REPRISE_FUZZ_SEED the seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRIALS = int(os.environ.get("REPRISE_FUZZ_TRIALS", "400"))
SEED = int(os.environ.get("REPRISE_FUZZ_SEED", "0"))
SCRIPT = Path(__file__).with_name("gguf_fuzz.py")


def test_fuzzed_gguf_files_import_or_are_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(TRIALS), str(SEED), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=max(600, TRIALS),
        check=False,
    )
    last_trial = done.stderr.strip().splitlines()[-1:]
    assert done.returncode == 0, f"the fuzz process ended with {done.returncode} at {last_trial}"
    result = json.loads(done.stdout)
    print(f"\ngguf fuzz: {TRIALS} trials, seed {SEED}")
    for outcome, count in sorted(result["outcomes"].items()):
        print(f"  {outcome:28} {count}")
    assert result["failures"] == []
    assert sum(result["outcomes"].values()) == TRIALS
    refused = {kind.split(":")[0] for kind in result["outcomes"] if kind.endswith("refused")}
    assert {"count", "length field", "tensor dims", "truncate", "merges"} <= refused

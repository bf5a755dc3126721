"""README's "From SFT to GRPO to transformers" block, run as written in a scratch folder (issue 29): each
`syncwise` command with overrides appended that only shorten it (steps, rollout size), the Python step
verbatim. A README that drifts from the program fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SHORTER = {
    "syncwise sft model.path": ["sft.steps=4", "sft.batch_size=8", "sft.eval_every=0"],
    "syncwise train": ["train.steps=2", "rl.prompts_per_rank=2", "rl.samples_per_prompt=2", "rl.max_new_tokens=12",
                       "train.progress=false"],
}


def _recipe() -> str:
    text = README.read_text()
    start = text.index("**From SFT to GRPO to transformers**")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def test_the_readme_recipe_runs_as_written(tmp_path):
    lines = _recipe().splitlines()
    script = []
    for line in lines:
        for prefix, extra in SHORTER.items():
            if line.startswith(prefix):
                line = f"{line} {' '.join(extra)}"
        if line.startswith("syncwise "):
            line = f"{sys.executable} -m {line}"
        if line.startswith("python -"):
            line = line.replace("python", sys.executable, 1)
        script.append(line)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "runs" / "sft_arith" / "export" / "chat_template.jinja").is_file()
    assert (tmp_path / "runs" / "grpo_arith" / "metrics.jsonl").is_file()
    assert "GRPO on data/arith/prompts.jsonl" in proc.stdout

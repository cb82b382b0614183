"""bench/common.py writes a Qwen3.5 shape as released (`-vl` shapes: a Qwen3_5ForConditionalGeneration checkpoint):
transformers reads it whole, and its language model is the text shape's checkpoint of the same seed. Run in a child
process with bench/ on its path, as the bench runs."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from common import write_model
import transformers
where = Path(sys.argv[2])
vl, text = write_model("tiny-qwen3.5-vl", where, "cpu"), write_model("tiny-qwen3.5", where, "cpu")
whole = transformers.AutoModelForImageTextToText.from_pretrained(vl, dtype=torch.float32)
alone = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
from lathe.models.hf import is_vl_path
ids = torch.randint(2, 1000, (2, 12))
with torch.no_grad():
    a = whole.model.language_model.embed_tokens(ids)
    b = alone.model.embed_tokens(ids)
    same = {n: torch.equal(p, dict(alone.named_parameters())[n.replace("model.language_model.", "model.")])
            for n, p in whole.named_parameters() if n.startswith("model.language_model.")}
print(json.dumps({"vl": is_vl_path(str(vl)), "architecture": type(whole).__name__, "embeddings": torch.equal(a, b),
                  "text_tensors": len(same), "text_equal": all(same.values()),
                  "tower": sum(p.numel() for n, p in whole.named_parameters() if ".visual." in n)}))
"""


def test_vl_form_of_a_qwen3_5_shape_is_the_released_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin",
                                                      "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vl"] and got["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert got["embeddings"] and got["text_equal"] and got["text_tensors"] > 10 and got["tower"] > 0

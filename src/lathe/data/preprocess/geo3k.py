"""Geometry3K -> verl parquet with images, row for row as verl's examples/data_preprocess/geo3k.py writes it.

Input: a local copy of the HF dataset `hiyouga/geometry3k` as HF datasets saves it: a folder holding
`data/<split>-00000-of-00001.parquet` (or `<split>-*.parquet` / `<split>.parquet` directly inside) for the
splits train and test, with columns `images` (a list of {"bytes", "path"} image structs), `problem` (text that
already carries one `<image>` placeholder per image) and `answer`.

Output rows: prompt = problem + " " + INSTRUCTION as one user message; `images` passed through unchanged; data_source
"hiyouga/geometry3k"; ability "math"; reward_model {"style": "rule", "ground_truth": answer}; extra_info
{split, index, answer, question=problem}. Scored by lathe.reward.geo3k.
`row_fn` builds another row layout from the same checked fields (geo3k_tool.py: the multi-turn tool variant).
"""

from __future__ import annotations

import glob
import io
import os
from typing import Any, Callable

from lathe.data.preprocess.common import PreprocessError, write_parquet

DATA_SOURCE = "hiyouga/geometry3k"
SPLITS = ("train", "test")
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. "
    r"The final answer MUST BE put in \boxed{}."
)

# (problem, answer, images, split, index) -> one verl-schema row
RowFn = Callable[[str, str, list, str, int], dict]


def geo3k_split_files(input_path: str) -> dict[str, list[str]]:
    """Map split -> its parquet shard(s) in a local copy of hiyouga/geometry3k (a folder, or one .parquet file)."""
    path = os.path.expanduser(input_path)
    if os.path.isfile(path):
        name = os.path.basename(path).lower()
        return {"test" if "test" in name else "train": [path]}
    if not os.path.isdir(path):
        raise PreprocessError(f"input not found: {path}. Fix: give the folder of a local copy of hiyouga/geometry3k "
                              "(e.g. from `huggingface-cli download hiyouga/geometry3k --repo-type dataset`).")
    found = {}
    for split in SPLITS:
        for folder in (os.path.join(path, "data"), path):
            shards = sorted(glob.glob(os.path.join(folder, f"{split}-*.parquet"))
                            + glob.glob(os.path.join(folder, f"{split}.parquet")))
            if shards:
                found[split] = shards
                break
    if not found:
        raise PreprocessError(f"{path}: no train/test parquet files inside (looked for data/train-*.parquet, "
                              "train-*.parquet, train.parquet and the same for test). Fix: point to the folder of "
                              "the downloaded dataset.")
    return found


def _check_row(row: dict, path: str, i: int) -> tuple[str, str, list]:
    """(problem, answer, images) of one raw row, or a PreprocessError naming the file, row and fix."""
    where = f"{path} row {i}"
    for key in ("problem", "answer"):
        value = row.get(key)
        if not isinstance(value, str) or not value.strip():
            raise PreprocessError(f"{where}: field '{key}' must be a non-empty string, got {value!r}"[:300]
                                  + ". Fix: correct or drop this row.")
    images = row.get("images")
    if not isinstance(images, list) or not images:
        raise PreprocessError(f"{where}: field 'images' must be a non-empty list of images, got "
                              f"{type(images).__name__}. Fix: use the dataset's images column (a list of "
                              "{'bytes', 'path'} structs).")
    n = row["problem"].count("<image>")
    if n != len(images):
        raise PreprocessError(f"{where}: the problem has {n} '<image>' placeholder(s) for {len(images)} image(s). "
                              "Fix: one '<image>' per image in the problem text, or drop this row.")
    return row["problem"], row["answer"], images


def _image_struct(image: Any, where: str) -> dict:
    """An image as HF datasets stores it: {"bytes": PNG/JPEG bytes or None, "path": str or None}."""
    if isinstance(image, dict) and (image.get("bytes") is not None or image.get("path")):
        return {"bytes": image.get("bytes"), "path": image.get("path")}
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    if isinstance(image, str):
        return {"bytes": None, "path": image}
    if hasattr(image, "save"):                      # a PIL image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}
    raise PreprocessError(f"{where}: unsupported image value {type(image).__name__}. Fix: images must be "
                          "{'bytes', 'path'} structs, bytes or paths.")


def geo3k_row(problem: str, answer: str, images: list, split: str, index: int) -> dict:
    """One verl-schema row with its images."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }


def convert_geo3k_files(paths: list[str], split: str, row_fn: RowFn = geo3k_row) -> list[dict]:
    """All rows of a split's raw parquet shards in verl's schema (built by `row_fn`); index counts rows from 0 across
    shards."""
    import pyarrow.parquet as pq
    rows = []
    for path in paths:
        try:
            raw_rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise PreprocessError(f"{path}: cannot read as parquet ({e}).") from None
        for i, raw in enumerate(raw_rows):
            problem, answer, images = _check_row(raw, path, i)
            structs = [_image_struct(im, f"{path} row {i}, images[{j}]") for j, im in enumerate(images)]
            rows.append(row_fn(problem, answer, structs, split, len(rows)))
    return rows


def preprocess_geo3k(input: str, output_dir: str, row_fn: RowFn = geo3k_row) -> dict[str, str]:
    """Convert a local hiyouga/geometry3k copy to `<output_dir>/{train,test}.parquet`; returns {split: path}."""
    out = os.path.expanduser(output_dir)
    written = {}
    for split, paths in geo3k_split_files(input).items():
        rows = convert_geo3k_files(paths, split, row_fn)
        written[split] = write_parquet(rows, os.path.join(out, f"{split}.parquet"))
    return written

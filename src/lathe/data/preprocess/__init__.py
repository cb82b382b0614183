"""Preprocess scripts: raw public data sets -> parquet in verl's schema.

PREPROCESSORS maps a data set name to `fn(input, output_dir) -> {split: parquet path}`;
`lathe preprocess <name> <input> <output_dir>` calls it.
"""

from __future__ import annotations

from typing import Callable

from lathe.data.preprocess.common import PreprocessError
from lathe.data.preprocess.geo3k import preprocess_geo3k
from lathe.data.preprocess.geo3k_tool import preprocess_geo3k_tool
from lathe.data.preprocess.gsm8k import preprocess_gsm8k
from lathe.data.preprocess.gsm8k_tool import preprocess_gsm8k_tool
from lathe.data.preprocess.math_sets import preprocess_aime24, preprocess_amc23, preprocess_math500

PREPROCESSORS: dict[str, Callable[[str, str], dict[str, str]]] = {
    "gsm8k": preprocess_gsm8k,
    "gsm8k_tool": preprocess_gsm8k_tool,                 # verl's gsm8k_multiturn_w_tool.py
    "gsm8k_multiturn_w_tool": preprocess_gsm8k_tool,     # the same, under verl's script name
    "math500": preprocess_math500,
    "aime24": preprocess_aime24,
    "amc23": preprocess_amc23,
    "geo3k": preprocess_geo3k,                           # images + <image> prompts (hiyouga/geometry3k)
    "geo3k_tool": preprocess_geo3k_tool,                 # verl's geo3k_multiturn_w_tool.py
    "geo3k_multiturn_w_tool": preprocess_geo3k_tool,     # the same, under verl's script name
}

__all__ = ["PREPROCESSORS", "PreprocessError", "preprocess_aime24", "preprocess_amc23", "preprocess_geo3k",
           "preprocess_geo3k_tool", "preprocess_gsm8k", "preprocess_gsm8k_tool", "preprocess_math500"]

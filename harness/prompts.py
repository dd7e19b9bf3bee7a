"""Prompts both the tests and the benchmarks run: an edit whose answer repeats its input (what speculation is for)."""

from __future__ import annotations

#: an edit task: a code block the answer repeats with a small change (what speculation is for)
EDIT_CODE = """def load_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config


def total(values):
    result = 0
    for value in values:
        result += value
    return result


def main():
    config = load_config("settings.ini")
    numbers = [int(v) for v in config.get("numbers", "").split(",") if v]
    print(total(numbers))
"""
EDIT_TASK = (
    "Here is a Python file:\n```python\n" + EDIT_CODE + "```\n"
    "Rename the function `total` to `sum_values` and return the whole file in a code block."
)
#: the same edit as a plain continuation: a model of any size goes on copying the file
EDIT_CONTINUATION = "```python\n" + EDIT_CODE + "```\nThe same file, with `total` renamed to `sum_values`:\n```python\n"

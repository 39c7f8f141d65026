"""Benchmark prompts from the file formats of the paper's benchmark families.

Recognised (by the fields of the records, not by file names, so any file of the same format works):
  gsm8k     jsonl  {"question", "answer": "... #### 72"}             answer: the number after ####
  math500   jsonl  {"problem", "answer"[, "solution"]}               answer: the reference final answer
  humaneval jsonl  {"task_id", "prompt", "entry_point", ...}         no checkable answer here
  ifeval    jsonl  {"key", "prompt", "instruction_id_list", ...}     no checkable answer (rule checkers)
  bbh       json   {"examples": [{"input", "target"}]}               answer: target
  mmlu-pro  jsonl  {"question", "options": [...], "answer": "C"}     answer: the option letter
  gpqa      jsonl/csv {"Question", "Correct Answer", "Incorrect Answer 1".."3"}   answer: the option letter
  plain     jsonl  {"prompt"} / {"question"} / {"input"} / {"text"}  no answer
A folder is searched recursively for *.jsonl, *.json and *.csv files (README and train* files are
skipped); `limit` takes prompts round-robin over the folder's files, so a BBH folder gives a mix
of subtasks.
"""
from __future__ import annotations

import csv
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """A prompt file that is missing or in no known format."""


@dataclass
class Prompt:
    id: str           # "<file stem>/<index>" or the record's own id
    family: str       # gsm8k, math500, humaneval, ifeval, bbh, mmlu-pro, gpqa, plain
    text: str         # the user message (rendered through the chat template later)
    answer: str | None = None   # reference final answer where the family has a checkable one
    source: str = ""  # file it came from


LETTERS = "ABCDEFGHIJKLMNOP"


def _mc_text(question: str, options: list[str]) -> str:
    lines = [question.strip(), ""] + [f"({LETTERS[i]}) {o}" for i, o in enumerate(options)]
    return "\n".join(lines) + "\nAnswer with the letter of the correct option."


def _gsm8k_answer(answer: str) -> str:
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def from_record(r: dict, index: int, stem: str, source: str) -> Prompt | None:
    """One record -> a Prompt, by its fields. None for records of no known shape."""
    rid = lambda key: f"{stem}/{r[key]}" if key in r else f"{stem}/{index}"  # noqa: E731
    if "question" in r and isinstance(r.get("answer"), str) and "####" in r["answer"]:
        return Prompt(f"{stem}/{index}", "gsm8k", r["question"], _gsm8k_answer(r["answer"]), source)
    if "problem" in r and "answer" in r:
        return Prompt(rid("unique_id"), "math500", r["problem"], str(r["answer"]), source)
    if "task_id" in r and "prompt" in r:
        return Prompt(str(r["task_id"]), "humaneval",
                      "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```", None, source)
    if "instruction_id_list" in r and "prompt" in r:
        return Prompt(rid("key"), "ifeval", r["prompt"], None, source)
    if "question" in r and isinstance(r.get("options"), list):
        ans = r.get("answer")
        if ans is None and isinstance(r.get("answer_index"), int):
            ans = LETTERS[r["answer_index"]]
        return Prompt(rid("question_id"), "mmlu-pro", _mc_text(r["question"], r["options"]),
                      str(ans).strip() if ans is not None else None, source)
    if "Question" in r and "Correct Answer" in r:
        opts = [r["Correct Answer"]] + [r[k] for k in ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3") if r.get(k)]
        opts = [str(o).strip() for o in opts]
        order = list(range(len(opts)))
        random.Random(f"{stem}/{index}").shuffle(order)     # deterministic option order
        return Prompt(rid("Record ID"), "gpqa", _mc_text(str(r["Question"]), [opts[i] for i in order]),
                      LETTERS[order.index(0)], source)
    if "input" in r and "target" in r:
        return Prompt(f"{stem}/{index}", "bbh", r["input"], str(r["target"]), source)
    for key in ("prompt", "question", "input", "text", "instruction"):
        if isinstance(r.get(key), str):
            return Prompt(f"{stem}/{index}", "plain", r[key], None, source)
    return None


def _records(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("examples"), list):
                return data["examples"]
            if isinstance(data, list):
                return data
            raise DataError(f"{path}: a JSON file must hold a list of records or {{\"examples\": [...]}}")
        if suffix == ".csv":
            with open(path, encoding="utf-8", newline="") as f:
                return list(csv.DictReader(f))
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    raise DataError(f"{path}: unknown prompt file type (expected .jsonl, .json or .csv)")


def load_file(path: Path) -> list[Prompt]:
    path = Path(path)
    out = []
    for i, r in enumerate(_records(path)):
        p = from_record(r, i, path.stem, str(path)) if isinstance(r, dict) else None
        if p is None:
            raise DataError(f"{path}: record {i} is in no known format (fields: {sorted(r) if isinstance(r, dict) else type(r).__name__})")
        out.append(p)
    return out


def data_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: no such file or folder")
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in (".jsonl", ".json", ".csv")
                   and not f.name.lower().startswith("train"))
    if not files:
        raise DataError(f"{path}: no .jsonl/.json/.csv prompt files in this folder")
    return files


def load_prompts(path, limit: int | None = None) -> list[Prompt]:
    """Prompts of one file or folder; with `limit`, at most that many, round-robin over files."""
    per_file = [load_file(f) for f in data_files(path)]
    if limit is None or len(per_file) == 1:
        flat = [p for ps in per_file for p in ps]
        return flat[:limit] if limit is not None else flat
    out, i = [], 0
    while len(out) < limit and any(i < len(ps) for ps in per_file):
        out.extend(ps[i] for ps in per_file if i < len(ps))
        i += 1
    return out[:limit]


# ------------------------------------------------------------------------ answer checking
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_float(s: str) -> float | None:
    try:
        return float(s.replace(",", "").rstrip("."))
    except ValueError:
        return None


def last_number(text: str) -> str | None:
    nums = _NUM.findall(text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def gsm8k_prediction(text: str) -> str | None:
    """The number after the last '####', else the last number in the text."""
    if "####" in text:
        n = last_number(text.rsplit("####", 1)[1].split("\n")[0]) or last_number(text.rsplit("####", 1)[1])
        if n is not None:
            return n
    return last_number(text)


def _boxed(text: str) -> str | None:
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1:k]
    return None


def normalize_math(s: str) -> str:
    s = s.strip().strip("$").strip()
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("dfrac", "frac"),
                 ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("\\$", ""),
                 ("\\text{", "{"), ("\\mbox{", "{"), (" ", "")):
        s = s.replace(a, b)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = s.rstrip(".")
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1]
    return s


def math_prediction(text: str) -> str | None:
    b = _boxed(text)
    if b is not None:
        return b
    m = re.findall(r"answer is:?\s*\$?([^\n$]+)", text)
    return m[-1] if m else last_number(text)


def _same_math(pred: str, ref: str) -> bool:
    a, b = normalize_math(pred), normalize_math(ref)
    if a == b:
        return True
    fa, fb = _to_float(a), _to_float(b)
    return fa is not None and fb is not None and abs(fa - fb) <= 1e-6 * max(1.0, abs(fb))


def _mc_prediction(text: str) -> str | None:
    m = re.findall(r"answer is:?\s*\(?([A-P])\b", text) or re.findall(r"\(([A-P])\)", text) or re.findall(r"\b([A-P])\b", text)
    return m[-1] if m else None


def _bbh_prediction(text: str) -> str:
    m = re.findall(r"answer is:?\s*(.+)", text)
    s = m[-1] if m else (text.strip().splitlines() or [""])[-1]
    return s.strip().rstrip(".").strip()


def check_answer(family: str, text: str, answer: str | None) -> bool | None:
    """Whether generated `text` states the reference `answer`; None where the family has no
    checkable answer. GSM8K: the number after '####' (else the last number) equals the reference;
    MATH-500: \\boxed{} content (else the last number) after light LaTeX normalisation or as
    numbers; BBH: the text after "the answer is" (else the last line); multiple choice: the letter."""
    if answer is None:
        return None
    if family == "gsm8k":
        pred = gsm8k_prediction(text)
        if pred is None:
            return False
        a, b = _to_float(pred), _to_float(answer)
        return a is not None and b is not None and abs(a - b) < 1e-6
    if family == "math500":
        pred = math_prediction(text)
        return pred is not None and _same_math(pred, answer)
    if family in ("mmlu-pro", "gpqa"):
        return _mc_prediction(text) == answer.strip().strip("()")
    if family == "bbh":
        pred = _bbh_prediction(text)
        norm = lambda s: s.strip().lower().strip("()")  # noqa: E731
        return norm(pred) == norm(answer) or norm(pred).startswith(norm(answer) + " ") or (
            answer.startswith("(") and f"{answer}" in pred)
    return None

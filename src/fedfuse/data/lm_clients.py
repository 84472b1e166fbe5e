"""Federations of text clients for LoRA fine-tuning: Shakespeare by speaking role, and a task split.

Rows are ``x`` (N, L) token ids and ``y`` (N, L) next-token targets; ``-100`` marks positions that carry no
loss (instruction prompts, padding), exactly as ``torch.nn.functional.cross_entropy`` ignores them.  A row
whose targets all count is plain language modelling; a row that starts with ignored targets is a
prompt → response pair (the response is what ROUGE scores).

* :func:`shakespeare_roles` — LEAF Shakespeare's raw per-role texts (``by_play_and_character``), one client
  per speaking role, the largest role of each of the most-represented plays (a persona split like the
  papers' RoleBench).  Each role's text is split contiguously into train / validation / test and cut into
  non-overlapping windows.
* :func:`task_split` — one generation task per client built from the local corpora (continue WikiText, PTB
  or Shakespeare; upper-case, lower-case, reverse the words, drop the vowels, word initials), each a
  prompt ``"<text> >> "`` followed by the answer.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.corpus import load_corpus
from fedfuse.data.datasets import resolve_data_dir
from fedfuse.errors import UserError
from fedfuse.types import ClientData, Federation, Split

IGNORE = -100
ROLES_TAR = "by_play_and_character.tar.gz"


def _cat(splits: Sequence[Split]) -> Split:
    xs = [s.x for s in splits if len(s)]
    if not xs:
        return Split(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long))
    return Split(torch.cat(xs), torch.cat([s.y for s in splits if len(s)]))


def windows(ids: Sequence[int], seq_len: int) -> Split:
    """Non-overlapping windows of ``seq_len + 1`` tokens: x = w[:-1], y = w[1:] (every target counts)."""
    a = np.asarray(ids, dtype=np.int64)
    n = max(0, (len(a) - 1) // seq_len)
    x = a[: n * seq_len].reshape(n, seq_len)
    y = a[1 : n * seq_len + 1].reshape(n, seq_len)
    return Split(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)))


def encode_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int, pad_id: int) -> Split:
    """Prompt/response id pairs → right-padded rows; only response tokens carry a target.

    The sequence ``prompt + response`` is truncated to ``max_len + 1`` tokens (the prompt is cut from the
    left if it alone is too long, keeping at least one response token).
    """
    rows_x, rows_y = [], []
    for prompt, resp in pairs:
        prompt, resp = list(prompt), list(resp)
        if not resp:
            continue
        keep_p = max(1, min(len(prompt), max_len + 1 - min(len(resp), max_len)))
        prompt = prompt[-keep_p:] if prompt else prompt
        seq = (prompt + resp)[: max_len + 1]
        x = seq[:-1]
        y = [IGNORE] * (len(prompt) - 1) + seq[len(prompt):]
        y = y[: len(x)]
        pad = max_len - len(x)
        rows_x.append(x + [pad_id] * pad)
        rows_y.append(y + [IGNORE] * pad)
    if not rows_x:
        return Split(torch.zeros(0, max_len, dtype=torch.long), torch.zeros(0, max_len, dtype=torch.long))
    return Split(torch.tensor(rows_x, dtype=torch.long), torch.tensor(rows_y, dtype=torch.long))


def make_federation(clients: list[tuple[str, Split, Split, Split]], vocab_size: int, *, dataset: str,
                    partition: str, device: torch.device | str = "cpu",
                    info: dict[str, Any] | None = None) -> Federation:
    """A language-model :class:`Federation`; ``info["client_names"]`` names each client (role or task)."""
    datas = [ClientData(i, tr.to(device), va.to(device), te.to(device), None) for i, (_, tr, va, te) in
             enumerate(clients)]
    width = max(int(c[1].x.shape[1]) for c in clients)
    return Federation(
        clients=datas,
        test=_cat([d.test for d in datas]),
        num_classes=vocab_size,
        input_shape=(width,),
        task="lm",
        dataset=dataset,
        partition=partition,
        info={**(info or {}), "client_names": [c[0] for c in clients]},
    )


# ----------------------------------------------------------------------------------- Shakespeare roles


def _roles_archive(data_dir: str | Path | None) -> Path:
    root = resolve_data_dir(data_dir)
    cands = [root / "shakespeare-leaf" / ROLES_TAR, root / ROLES_TAR] if root else []
    cands.append(Path("../shared/data/shakespeare-leaf") / ROLES_TAR)
    for c in cands:
        if c.is_file():
            return c
    from fedfuse.data.dataset import DatasetNotFoundError

    raise DatasetNotFoundError(f"LEAF Shakespeare raw roles ({ROLES_TAR}) not found; looked at "
                               f"{', '.join(map(str, cands))}")


def read_roles(data_dir: str | Path | None = None) -> dict[str, str]:
    """``{PLAY_ROLE: text}`` from LEAF's ``by_play_and_character`` (tarball or unpacked folder)."""
    root = resolve_data_dir(data_dir)
    folder = None
    if root is not None:
        for c in (root / "shakespeare-leaf" / "data" / "raw_data" / "by_play_and_character",
                  root / "raw_data" / "by_play_and_character"):
            if c.is_dir():
                folder = c
    if folder is not None:
        return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))}
    out: dict[str, str] = {}
    with tarfile.open(_roles_archive(data_dir)) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.isfile() and m.name.endswith(".txt"):
                f = tar.extractfile(m)
                if f is not None:
                    out[Path(m.name).stem] = io.TextIOWrapper(f, encoding="utf-8").read()
    return out


def read_plays(data_dir: str | Path | None = None) -> dict[str, str]:
    """``{PLAY_ROLE: play title}`` from LEAF's ``users_and_plays.json`` ({} when absent)."""
    import json

    root = resolve_data_dir(data_dir)
    cands = [root / "shakespeare-leaf" / "data" / "raw_data" / "users_and_plays.json",
             root / "raw_data" / "users_and_plays.json"] if root else []
    cands.append(Path("../shared/data/shakespeare-leaf/data/raw_data/users_and_plays.json"))
    for c in cands:
        if c.is_file():
            return {str(k): str(v) for k, v in json.loads(c.read_text(encoding="utf-8")).items()}
    return {}


def pick_roles(texts: dict[str, str], plays: dict[str, str], count: int, min_chars: int) -> list[str]:
    """``count`` roles, round-robin over plays: the largest role of every play, then the second largest...

    Plays are ordered by their largest role's size; roles without a known play form their own play.
    """
    by_play: dict[str, list[tuple[int, str]]] = {}
    for name, text in texts.items():
        if len(text) >= min_chars:
            by_play.setdefault(plays.get(name, name), []).append((len(text), name))
    for v in by_play.values():
        v.sort(key=lambda t: (-t[0], t[1]))
    order = sorted(by_play, key=lambda p: (-by_play[p][0][0], p))
    picked: list[str] = []
    depth = 0
    while len(picked) < count and any(len(by_play[p]) > depth for p in order):
        picked += [by_play[p][depth][1] for p in order if len(by_play[p]) > depth][: count - len(picked)]
        depth += 1
    if len(picked) < count:
        raise UserError(f"only {len(picked)} roles have >= {min_chars} characters; ask for fewer clients")
    return picked


def shakespeare_roles(tokenizer: Any, data_dir: str | Path | None = None, *, clients: int = 8, seq_len: int = 64,
                      max_chars: int = 6000, fractions: tuple[float, float] = (0.7, 0.1),
                      device: torch.device | str = "cpu") -> Federation:
    """One client per speaking role (round-robin over plays, largest roles first), LM windows of ``seq_len``.

    The first ``max_chars`` characters of a role are split contiguously: ``fractions`` = (train, val), the
    rest test.  A client's group is its play (for the merging-weight ARI).  Deterministic (no seed needed).
    """
    texts = read_roles(data_dir)
    plays = read_plays(data_dir)
    names = pick_roles(texts, plays, clients, min_chars=min(max_chars, 20 * (seq_len + 1)))
    play_ids = {p: i for i, p in enumerate(dict.fromkeys(plays.get(n, n) for n in names))}
    rows = []
    for name in names:
        text = re.sub(r"[ \t]+", " ", texts[name])[:max_chars]
        ids = tokenizer.encode(text)
        a, b = int(fractions[0] * len(ids)), int((fractions[0] + fractions[1]) * len(ids))
        rows.append((name, windows(ids[:a], seq_len), windows(ids[a:b], seq_len), windows(ids[b:], seq_len)))
    fed = make_federation(rows, len(tokenizer), dataset="shakespeare-roles", partition="role", device=device,
                          info={"max_chars": max_chars, "seq_len": seq_len,
                                "plays": [plays.get(n, n) for n in names]})
    for c, name in zip(fed.clients, names):
        c.group = play_ids[plays.get(name, name)]
    return fed


# ----------------------------------------------------------------------------------------- task split

def _vowelless(s: str) -> str:
    return re.sub(r"[aeiouAEIOU]", "", s)


TASKS: dict[str, tuple[str, Callable[[str], str] | None]] = {
    # name: (source corpus, transform; None = continue the text)
    "continue-wikitext": ("wikitext2", None),
    "continue-ptb": ("ptb", None),
    "continue-shakespeare": ("tiny-shakespeare", None),
    "uppercase": ("wikitext2", str.upper),
    "lowercase": ("tiny-shakespeare", str.lower),
    "reverse-words": ("ptb", lambda s: " ".join(reversed(s.split()))),
    "drop-vowels": ("wikitext2", _vowelless),
    "initials": ("tiny-shakespeare", lambda s: " ".join(w[0] for w in s.split())),
}


def _corpus_text(name: str, data_dir: str | Path | None) -> str:
    if name == "tiny-shakespeare":
        root = resolve_data_dir(data_dir)
        cands = [root / "tiny-shakespeare" / "input.txt"] if root else []
        cands.append(Path("../shared/data/tiny-shakespeare/input.txt"))
        for c in cands:
            if c.is_file():  # one line per speech (the file breaks verse lines; speeches end at blank lines)
                speeches = c.read_text(encoding="utf-8").split("\n\n")
                return "\n".join(" ".join(s.split("\n")[1:]) for s in speeches) + "\n"
        from fedfuse.data.dataset import DatasetNotFoundError

        raise DatasetNotFoundError(f"tiny-shakespeare/input.txt not found; looked at {', '.join(map(str, cands))}")
    return load_corpus(name, "test", data_dir)  # the base never saw the test splits of WikiText-2 / PTB


def _snippets(text: str, width: int, count: int, rng: np.random.Generator) -> list[str]:
    """``count`` word-aligned snippets of about ``width`` characters from random places of ``text``."""
    out = []
    lines = [ln.strip() for ln in text.split("\n") if len(ln.strip()) > 2 * width]
    for i in rng.permutation(len(lines))[: count]:
        words = lines[i].split()
        start = int(rng.integers(0, max(1, len(words) // 2)))
        s = ""
        for w in words[start:]:
            if len(s) + len(w) + 1 > width:
                break
            s = f"{s} {w}" if s else w
        if s:
            out.append(s)
    return out


def task_split(tokenizer: Any, data_dir: str | Path | None = None, *, tasks: Sequence[str] | None = None,
               train: int = 150, val: int = 20, test: int = 40, width: int = 24, seed: int = 0,
               device: torch.device | str = "cpu") -> Federation:
    """One client per generation task (:data:`TASKS`): prompt ``"<text> >> "``, answer the task's output.

    Continuation tasks show ``width`` characters and ask for the next ``width``.  Snippets are drawn with
    ``seed``; every client's rows are disjoint across train / val / test.
    """
    names = list(tasks or TASKS)
    rng = np.random.default_rng(seed)
    texts: dict[str, str] = {}
    rows = []
    max_len = 3 * width + 8
    for name in names:
        if name not in TASKS:
            raise UserError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
        src, fn = TASKS[name]
        if src not in texts:
            texts[src] = _corpus_text(src, data_dir)
        n = train + val + test
        w = 2 * width if fn is None else width
        snips = _snippets(texts[src], w, n, rng)
        if len(snips) < n:
            raise UserError(f"task {name}: only {len(snips)} snippets available, need {n}")
        pairs = []
        for s in snips:
            if fn is None:
                cut = s.rfind(" ", 0, len(s) // 2 + 1)
                cut = cut if cut > 0 else len(s) // 2
                prompt, answer = s[:cut], s[cut:]
            else:
                prompt, answer = s, " " + fn(s)
            pairs.append((tokenizer.encode(prompt + " >>"), tokenizer.encode(answer + "\n")))
        pad = getattr(tokenizer, "pad_id", 0)
        rows.append((name, encode_pairs(pairs[:train], max_len, pad),
                     encode_pairs(pairs[train:train + val], max_len, pad),
                     encode_pairs(pairs[train + val:], max_len, pad)))
    return make_federation(rows, len(tokenizer), dataset="lm-tasks", partition="task", device=device,
                           info={"tasks": names, "width": width})

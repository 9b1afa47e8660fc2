"""Conversations for chat fine-tuning: rows -> messages -> the model's own chat template -> tokens, each with an
owner byte (who wrote it, which part of a turn) from which the loss mask is chosen at train time.

Rows (`python -m workbench.data prepare SRC OUT --chat`, auto-detected when a row has `messages`):

* `{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}, ...], "tools"?: [...]}`, roles system
  (first only), user, assistant, tool;
* `{"prompt", "completion"}`: two strings (one user turn, one assistant turn) or two lists of messages;
* the bundled chitchat shape: `messages` = a list of turns, each a list of utterances `{"text", "sender"}`; the
  first sender is the user, the other the assistant, a turn's utterances joined with "\\n".

Rendering is the tokenizer's `apply_chat_template(messages, tools=tools, tokenize=False)` through transformers, then
the fast tokenizer with offsets: token for token what `apply_chat_template(..., tokenize=True)` gives for the whole
conversation (tests check every bundled conversation). Owners come from reading the rendered text's structure
(`<|im_start|>role\\n` ... `<|im_end|>`, `<think>`...`</think>`, `<tool_call>`...`</tool_call>`, tool responses
inside user turns), never from prefix differences: Qwen3's template rewrites earlier turns.

The owner byte of a token (`kind | LAST_TURN`) says what the token is as a *target*:

    0 TEMPLATE   markup: `<|im_start|>role\\n`, the newline after `<|im_end|>`, a non-assistant `<|im_end|>`
    1 SYSTEM     2 USER     3 TOOL (a tool response)
    4 THINK      an assistant turn's `<think>...</think>\\n\\n` block (the template keeps it in the last turns only)
    5 TOOL_CALL  an assistant turn's `<tool_call>...</tool_call>` blocks (with the newline before each)
    6 CONTENT    an assistant turn's reply text
    7 END        the `<|im_end|>` that closes an assistant turn (the stop token the model must learn)
    +8 LAST_TURN the token belongs to the conversation's last assistant turn

A token whose characters have several owners (BPE merges across a boundary, e.g. the header's newline with a reply
that starts with one) takes the highest kind: the kinds are numbered so that what is trained wins.

Which kinds are trained is `training.loss_on` with `training.train_thinking` / `train_tool_calls` (`trained_lut`):
the mask is stored per owner, so changing them needs no new prepare.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np

TEMPLATE, SYSTEM, USER, TOOL, THINK, TOOL_CALL, CONTENT, END = range(8)  # the order is a priority (see above)
LAST_TURN = 8
KIND_NAMES = ("template", "system", "user", "tool", "think", "tool_call", "content", "end")
ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CONTROL_TOKENS = (IM_START, IM_END, "<|endoftext|>")  # refused inside text: they would forge a turn boundary
LOSS_ON = ("assistant", "last_assistant", "all")


class BadConversation(ValueError):
    """A row that is not a conversation the template can render: `kind` (counted in the manifest) and the reason
    (shown with the row's location)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


# ------------------------------------------------------------------------------------------------
# Rows -> messages
# ------------------------------------------------------------------------------------------------


def is_chat_row(row, text_field: str = "text") -> bool:
    """A row prepare reads as a conversation: it has `messages` (or `prompt` and `completion`) and no text field."""
    return isinstance(row, dict) and text_field not in row and (
        "messages" in row or ("prompt" in row and "completion" in row))


def detect(dataset: str, text_field: str = "text") -> bool:
    """Whether a raw dataset holds conversations: its first row is one (`is_chat_row`); text files never are."""
    from workbench.data import document_sources
    from workbench.data.sources import read_unit

    kind, path = document_sources(dataset)[0]
    if kind == "file":
        return False
    size = path.stat().st_size
    kinds = {".jsonl": "jsonl", ".parquet": "parquet", ".json": "json"}
    unit = {"kind": kinds.get(path.suffix, "arrow"), "path": str(path), "start": 0, "stop": size if
            path.suffix == ".jsonl" else 1, "first": 1 if path.suffix == ".jsonl" else 0, "bytes": size}
    for _, row, _ in read_unit(unit, None):  # the first row only (the reader is lazy)
        return is_chat_row(row, text_field)
    return False


def audit(records: list[dict], source: str) -> dict:
    """The stop audit over a preparation's shard records: trained `<|im_end|>` = assistant turns, else refuses.

    Returns:
        The manifest's conversation counts: assistant_turns, trained_ends, bad_kinds (bad rows per kind).
    """
    from workbench.core.errors import DatasetError

    turns = sum(r["assistant_turns"] for r in records)
    ends = sum(r["trained_ends"] for r in records)
    if turns != ends:
        raise DatasetError(f"{source}: stop audit failed: {turns:,} assistant turns but {ends:,} trained "
                           f"{IM_END} tokens.", "use a Qwen3-style chat template, or report the template.")
    kinds: dict[str, int] = {}
    for r in records:
        for k, n in r["bad_kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
    return {"assistant_turns": turns, "trained_ends": ends, "bad_kinds": dict(sorted(kinds.items()))}


def conversation(row) -> tuple[list[dict], list | None]:
    """(messages, tools) of one row, checked (see the module docstring for the shapes).

    Raises:
        BadConversation: no assistant turn, roles out of order or unknown, a tool message without a call, content
            that is not a string or is empty, a control token inside the text.
    """
    if not isinstance(row, dict):
        raise BadConversation("not a conversation", f"a JSON {type(row).__name__}, not an object with 'messages'")
    if row.get("messages") is not None:
        messages = row["messages"]
        if isinstance(messages, list) and messages and all(isinstance(t, list) for t in messages):
            messages = _from_utterances(messages)
    elif row.get("prompt") is not None and row.get("completion") is not None:
        p, c = row["prompt"], row["completion"]
        messages = (([{"role": "user", "content": p}] if isinstance(p, str) else p) +
                    ([{"role": "assistant", "content": c}] if isinstance(c, str) else c))
    else:
        raise BadConversation("not a conversation",
                              f"no 'messages' (or 'prompt' and 'completion'); keys: {sorted(row)[:8]}")
    if not isinstance(messages, list) or not messages:
        raise BadConversation("not a conversation", "'messages' is not a non-empty list of turns")
    tools = row.get("tools")
    if isinstance(tools, str):  # parquet / arrow datasets often keep the schemas as one JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadConversation("bad tools", "'tools' is a string that is not JSON") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadConversation("bad tools", "'tools' is not a list of JSON schemas")
    return _checked(messages), tools or None


def _from_utterances(turns: list[list]) -> list[dict]:
    """chitchat's turns (lists of `{text, sender}`) -> user/assistant messages: the first sender is the user."""
    senders: list = []
    out = []
    for k, turn in enumerate(turns):
        if not turn or not all(isinstance(u, dict) and isinstance(u.get("text"), str) for u in turn):
            raise BadConversation("content not a string", f"turn {k} is not a list of utterances with a string 'text'")
        who = {u.get("sender") for u in turn}
        if len(who) != 1:
            raise BadConversation("roles out of order", f"turn {k} mixes senders {sorted(map(str, who))}")
        sender = who.pop()
        if sender not in senders:
            senders.append(sender)
        if len(senders) > 2:
            raise BadConversation("unknown role", f"turn {k} brings a third sender {sender!r}; a conversation has two")
        out.append({"role": ("user", "assistant")[senders.index(sender)],
                    "content": "\n".join(u["text"] for u in turn)})
    return out


def _checked(messages: list) -> list[dict]:
    """Messages without None values (as apply_chat_template drops them), in an order the template renders."""
    out, prev, calls_left = [], None, 0
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadConversation("not a conversation",
                                  f"message {k} is a {type(m).__name__}, not an object with 'role' and 'content'")
        m = {key: v for key, v in m.items() if v is not None}
        role = m.get("role")
        if role not in ROLES:
            raise BadConversation("unknown role", f"message {k} has role {role!r}; roles are {', '.join(ROLES)}")
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            _check_calls(k, calls)
            m.setdefault("content", "")  # a turn of calls only: the template reads its content
        content = m.get("content")
        if not isinstance(content, str):
            raise BadConversation("content not a string",
                                  f"message {k} ({role}) has content of type {type(content).__name__}, not a string")
        if not content.strip() and not (role == "assistant" and calls):
            raise BadConversation("empty content", f"message {k} ({role}) has empty content")
        if not isinstance(m.get("reasoning_content", ""), str):
            raise BadConversation("content not a string", f"message {k} has reasoning_content that is not a string")
        text = content + m.get("reasoning_content", "") + json.dumps(calls, default=str)
        if any(t in text for t in CONTROL_TOKENS):
            raise BadConversation("control token", f"message {k} ({role}) contains a control token "
                                  f"({', '.join(t for t in CONTROL_TOKENS if t in text)})")
        allowed = {None: ("system", "user"), "system": ("user",), "user": ("assistant",),
                   "assistant": ("user", "tool") if calls_left else ("user",),
                   "tool": ("tool", "assistant") if calls_left else ("assistant",)}[prev]
        if role == "tool" and not calls_left:
            raise BadConversation("tool response without a call", f"message {k} is a tool response without a call "
                                  "(no tool_calls left in the assistant turn before it)")
        if role not in allowed:
            raise BadConversation("roles out of order", f"message {k} ({role}) follows {prev or 'nothing'}; expected "
                                  f"{' or '.join(allowed)} (system first, then user and assistant taking turns, "
                                  "tool responses after an assistant turn with tool_calls)")
        calls_left = len(calls) if role == "assistant" else calls_left - 1 if role == "tool" else 0
        out.append(m)
        prev = role
    if not any(m["role"] == "assistant" for m in out):
        raise BadConversation("no assistant turn", "no assistant turn (nothing to learn from)")
    return out


def _check_calls(k: int, calls) -> None:
    if not isinstance(calls, list):
        raise BadConversation("bad tool call", f"message {k} has tool_calls that is not a list")
    for c in calls:
        f = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or \
                not isinstance(f.get("arguments", {}), (dict, str)):
            raise BadConversation("bad tool call",
                                  f"message {k} has a tool call without a string 'name' and object 'arguments'")


# ------------------------------------------------------------------------------------------------
# The rendered text -> owners
# ------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"<\|im_start\|>([a-z_]+)\n?(.*?)<\|im_end\|>", re.S)
_TOOL_CALL = re.compile(r"\n?<tool_call>.*?</tool_call>", re.S)
_BODY_KIND = {"system": SYSTEM, "user": USER, "tool": TOOL}


def char_owners(text: str) -> np.ndarray:
    """The owner byte of every character of a rendered conversation, read from its structure alone."""
    own = np.full(len(text), TEMPLATE, dtype=np.uint8)
    blocks = list(_BLOCK.finditer(text))
    last = max((i for i, b in enumerate(blocks) if b.group(1) == "assistant"), default=-1)
    for i, b in enumerate(blocks):
        role, (a, z) = b.group(1), b.span(2)
        body = b.group(2)
        if role != "assistant":
            tool = role == "user" and body.startswith("<tool_response>") and body.endswith("</tool_response>")
            own[a:z] = TOOL if tool else _BODY_KIND.get(role, USER)
            continue
        flag = LAST_TURN if i == last else 0
        own[a:z] = CONTENT | flag
        if body.startswith("<think>") and (t := body.find("</think>")) >= 0:
            t += len("</think>")
            t += len(body[t:]) - len(body[t:].lstrip("\n"))
            own[a:a + t] = THINK | flag
        for c in _TOOL_CALL.finditer(body):
            own[a + c.start():a + c.end()] = TOOL_CALL | flag
        own[z:b.end()] = END | flag  # the closing <|im_end|>
    return own


def trained_lut(loss_on: str = "assistant", thinking: bool = True, tool_calls: bool = True) -> np.ndarray:
    """owner byte -> trained (bool[16]): what `training.loss_on` and its options train."""
    lut = np.zeros(16, dtype=bool)
    if loss_on == "all":
        lut[:] = True
        return lut
    kinds = [CONTENT, END] + [THINK] * thinking + [TOOL_CALL] * tool_calls
    for k in kinds:
        lut[k | LAST_TURN] = True
        lut[k] = loss_on == "assistant"
    return lut


# ------------------------------------------------------------------------------------------------
# Rendering with a tokenizer
# ------------------------------------------------------------------------------------------------


@functools.cache
def _hf_tokenizer(path: str, size: int, mtime_ns: int):
    """transformers' tokenizer of a tokenizer directory (its chat_template), loaded once per process."""
    from transformers import AutoTokenizer

    del size, mtime_ns  # the cache key: a changed tokenizer.json is loaded again
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise ValueError(f"the tokenizer in {path} has no chat_template (tokenizer_config.json) to render "
                              "conversations with")
    return tok


def hf_tokenizer(tokenizer_dir: str | Path):
    f = Path(tokenizer_dir) / "tokenizer.json"
    st = f.stat()
    return _hf_tokenizer(str(Path(tokenizer_dir).resolve()), st.st_size, st.st_mtime_ns)


class Rendered:
    """One conversation rendered: `ids` (uint32), `owners` (uint8, one per token), `assistant_turns`, `chars` (of
    the rendered text)."""

    __slots__ = ("ids", "owners", "assistant_turns", "chars")

    def __init__(self, ids: np.ndarray, owners: np.ndarray, assistant_turns: int, chars: int):
        self.ids, self.owners, self.assistant_turns, self.chars = ids, owners, assistant_turns, chars

    @property
    def trained_ends(self) -> int:
        """`<|im_end|>` tokens owned as the end of an assistant turn (the stop audit counts them)."""
        return int(((self.owners & 7) == END).sum())


def append(tok, batch: list[tuple[str, dict]], tokens_file, owners_file) -> tuple[list[int], list, dict]:
    """Renders a batch of (location, row) and appends each good conversation's ids (uint32) and owner bytes to the
    files, in order.

    Returns:
        (the good conversations' lengths in tokens, [(location, BadConversation)] of the bad rows, counts: chars,
        assistant_turns, trained_ends).

    Raises:
        ValueError: the stop audit failed (see `render`).
    """
    lengths, bad = [], []
    counts = {"chars": 0, "assistant_turns": 0, "trained_ends": 0}
    for (where, _), r in zip(batch, render(tok, [row for _, row in batch]), strict=True):
        if isinstance(r, BadConversation):
            bad.append((where, r))
            continue
        r.ids.tofile(tokens_file)
        r.owners.tofile(owners_file)
        lengths.append(len(r.ids))
        counts["chars"] += r.chars
        counts["assistant_turns"] += r.assistant_turns
        counts["trained_ends"] += r.trained_ends
    return lengths, bad, counts


def render(tok, rows: list) -> list[Rendered | BadConversation]:
    """Renders rows with `tok` (from `hf_tokenizer`): a `Rendered` per good row, the `BadConversation` per bad one.

    Raises:
        ValueError: the stop audit failed for a row (its `<|im_end|>` owners do not match its assistant turns): the
            template is not one this reader understands.
    """
    out: list = []
    texts, slots = [], []
    end_id = tok.convert_tokens_to_ids(IM_END)
    for row in rows:
        try:
            messages, tools = conversation(row)
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
        except BadConversation as e:
            out.append(e)
            continue
        except Exception as e:  # noqa: BLE001 - jinja's errors have many classes; the row is bad, whatever it is
            out.append(BadConversation("template failed", f"the chat template failed to render it ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:120] if str(e) else ''})"))
            continue
        slots.append((len(out), sum(m["role"] == "assistant" for m in messages)))
        texts.append(text)
        out.append(None)
    for text, enc, (slot, turns) in zip(texts, tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False),
                                        slots, strict=True):
        ids = np.asarray(enc.ids, dtype=np.uint32)
        starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(ids))
        owners = np.maximum.reduceat(char_owners(text), starts) if len(ids) else np.zeros(0, np.uint8)
        r = Rendered(ids, owners, turns, len(text))
        ends = int(((owners & 7) == END)[ids == end_id].sum())
        if ends != turns or r.trained_ends != turns:
            raise ValueError(f"stop audit: {turns} assistant turn(s) but {ends} assistant-closing {IM_END} token(s) "
                             f"found in the rendering {text[:80]!r}...")
        out[slot] = r
    return out

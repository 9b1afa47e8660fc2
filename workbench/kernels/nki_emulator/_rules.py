"""The emulator's one error: a kernel broke a documented NKI rule (the bottom of the emulator: imports nothing)."""

from __future__ import annotations


class NkiRuleError(RuntimeError):
    """A kernel broke a documented NKI/NeuronCore rule; the message names the rule, the fix and the doc page."""

    def __init__(self, rule: str, detail: str, url: str):
        self.rule = rule
        super().__init__(f"[{rule}] {detail} (see {url})")


def violation(rule: str, detail: str, url: str) -> NkiRuleError:
    return NkiRuleError(rule, detail, url)

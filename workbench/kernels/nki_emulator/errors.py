"""The emulator's one error, a kernel broke a documented NKI rule: `violation` builds it (the class is
`workbench.core.errors.NkiRuleError`). The bottom of the emulator."""

from __future__ import annotations

from workbench.core.errors import NkiRuleError


def violation(rule: str, detail: str, url: str) -> NkiRuleError:
    return NkiRuleError(rule, detail, url)

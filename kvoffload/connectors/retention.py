"""Which block boundaries keep their STATE checkpoint (KDA / Mamba): a retention policy, engine-agnostic.

A hit can only end at a boundary whose checkpoint is stored (`plan.hit_blocks`), and most inner
boundaries of a prompt never end one: a later request that re-sends the prompt and extends it hits at
the prompt's own end. At GLM-5.3-Flash's vLLM block (4352 tokens) a block's checkpoints are 148 MB against
a 51 MB MLA page, so storing one at every boundary is most of what an offload tier writes.

A policy is a '+'-joined set of rules, each naming boundaries that keep their checkpoint:
- `every`: every boundary that can end a hit (what was stored before policies existed);
- `last`: the prompt's longest hit, `max_hit_blocks(layout, num_prompt_tokens)` blocks: where a request
  that re-sends this prompt, or extends it, ends its hit;
- `every:K`: every K-th boundary that can end a hit, counted from the start of the prompt;
- `exp`: the 1st, 2nd, 4th, 8th, ... boundary from the start (a shared prefix of any length still hits
  at least half of it, for log2(blocks) checkpoints);
- `backexp`: the boundaries 1, 2, 4, 8, ... before the last one (a prompt re-sent with its end edited or
  cut, a conversation branched near its end, still hits all but about the edited part);
- `junction`: where this prompt diverges from a prefix already stored without a checkpoint there
  (`plan.hit_and_junction`: the PAGED pages run on past the hit), or from one the engine holds (vLLM's
  `shared_prefix_boundary`, its Marconi-style junction): a proven shared prefix, so the next request
  that shares it hits there. At most one checkpoint per request, and only where sharing was seen.
Only boundaries that are multiples of the layout's hit alignment can end a hit, so the rules count
those ("hit-able boundaries": every `hit_alignment // block_size` blocks); at the usual alignment of
one block they are every block boundary. Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..spec.layout import LayoutView
from .plan import max_hit_blocks

RULES = ("every", "every:K", "last", "exp", "backexp", "junction")


@dataclass(frozen=True, slots=True)
class StateRetention:
    """A parsed policy (`parse`); `str()` gives back its canonical spelling."""

    last: bool = False
    every: int = 0  # keep every `every`-th hit-able boundary; 0: no periodic rule, 1: all of them
    exp: bool = False  # hit-able boundaries 1, 2, 4, ... from the start
    backexp: bool = False  # hit-able boundaries 1, 2, 4, ... before the last one
    junction: bool = False  # the boundary where the prompt diverges from a stored or held prefix

    def __post_init__(self):
        if self.every < 0 or not (self.last or self.every or self.exp or self.backexp or self.junction):
            raise ConfigError(f"state retention keeps no checkpoint at all: {self!r}")

    @classmethod
    def parse(cls, text: str) -> StateRetention:
        """From 'every', 'last', 'last+junction', 'last+every:K', 'last+exp', 'last+backexp' or any
        '+'-joined set of those rules; a typo, a repeated rule or a bad K is a `ConfigError` naming it."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(
                f"state retention must be a non-empty string of rules {RULES} joined by '+', got {text!r}"
            )
        rules: dict[str, Any] = {}  # field -> value (an int K, or True)
        for term in (t.strip() for t in text.split("+")):
            name, colon, value = term.partition(":")
            if name == "every" and colon:
                if not (value.isdigit() and int(value) > 0):
                    raise ConfigError(f"state retention {text!r}: every:K needs a whole number K >= 1, got {value!r}")
                setting = int(value)
            elif name in ("every", "last", "exp", "backexp", "junction") and not colon:
                setting = 1 if name == "every" else True
            else:
                raise ConfigError(
                    f"state retention {text!r}: unknown rule {term!r}; rules: {', '.join(RULES)}, "
                    "joined by '+' (e.g. 'last+exp')"
                )
            if name in rules:
                raise ConfigError(f"state retention {text!r}: rule {name!r} given twice")
            rules[name] = setting
        if rules.get("every") == 1:  # every boundary: the other rules add nothing
            return cls(every=1)
        return cls(**rules)

    def __str__(self) -> str:
        if self.every == 1:
            return "every"
        terms = ["last"] if self.last else []
        terms += ["junction"] if self.junction else []
        terms += [f"every:{self.every}"] if self.every else []
        terms += ["exp"] if self.exp else []
        terms += ["backexp"] if self.backexp else []
        return "+".join(terms)

    def keeper(
        self, layout: LayoutView, num_prompt_tokens: int, key_blocks: int | None = None, junction: int = 0
    ) -> Callable[[int], bool]:
        """For one request of `num_prompt_tokens`: boundary (blocks) -> whether its checkpoint is stored
        (`plan.plan_save`'s `keep`). `key_blocks`: the request's keys stop there (a per-request cap), and
        so does its longest hit; `junction`: the boundary (blocks; 0: none) where the prompt diverged from
        a shared prefix."""
        step = layout.hit_alignment // layout.block_size
        last = longest_hit(layout, num_prompt_tokens, key_blocks) // step

        def keeps(boundary: int) -> bool:
            if boundary < 1 or boundary % step:
                return False  # no hit can end there
            j = boundary // step
            if self.every and j % self.every == 0:
                return True
            if self.last and j == last:
                return True
            if self.exp and j & (j - 1) == 0:
                return True
            if self.junction and junction and j == junction // step:
                return True
            back = last - j
            return self.backexp and back > 0 and back & (back - 1) == 0

        return keeps

    def boundaries(
        self,
        layout: LayoutView,
        num_prompt_tokens: int,
        full_blocks: int,
        key_blocks: int | None = None,
        junction: int = 0,
    ) -> list[int]:
        """The kept boundaries (in blocks) among 1..full_blocks."""
        keep = self.keeper(layout, num_prompt_tokens, key_blocks, junction)
        return [k for k in range(1, full_blocks + 1) if keep(k)]

    def state_blocks(
        self,
        layout: LayoutView,
        num_prompt_tokens: int,
        blocks: Iterable[int],
        key_blocks: int | None = None,
        junction: int = 0,
    ) -> list[int]:
        """Of the blocks an engine holds a checkpoint after (`pages_for_save`'s `state_blocks`: block i
        ends at boundary i + 1), those whose checkpoint is kept."""
        keep = self.keeper(layout, num_prompt_tokens, key_blocks, junction)
        return [i for i in blocks if keep(i + 1)]


def longest_hit(layout: LayoutView, num_prompt_tokens: int, key_blocks: int | None = None) -> int:
    """The boundary (in blocks) where the longest hit of this prompt ends: `max_hit_blocks`, within the
    request's keys when they stop early (`key_blocks`), aligned."""
    last = max_hit_blocks(layout, num_prompt_tokens)
    if key_blocks is not None and key_blocks < last:
        step = layout.hit_alignment // layout.block_size
        last = key_blocks // step * step
    return last


EVERY = StateRetention(every=1)
DEFAULT = StateRetention(last=True, junction=True)  # BENCHMARKS.md, "KDA checkpoint retention": measured


def as_retention(value: str | StateRetention | None) -> StateRetention:
    """A policy from a string (parsed), a policy (as is) or None (`DEFAULT`)."""
    if value is None:
        return DEFAULT
    return value if isinstance(value, StateRetention) else StateRetention.parse(value)

"""When a sequence stops early: stop token ids (EOS among them) and stop strings.

A sequence stops with reason "stop" right after the token that
  - is one of ``ids`` (the request's stop token ids, plus the model's EOS ids when EOS applies), or
  - completes one of ``strings`` in the decoded text of the generated tokens.
That token is kept, like every token before it. Tokens are decoded with the model's
``tokenizers.Tokenizer`` (special tokens included as text). Only the last ``window`` tokens are decoded
per check: each token decodes to at least one byte, so a string of B UTF-8 bytes completed by the
newest token lies within its last B tokens; the window adds two tokens of margin for decoders that
strip a leading space. An occurrence that ended earlier was caught by the check at that token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

WINDOW_MARGIN = 2


@dataclass(frozen=True, slots=True)
class StopRule:
    ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()
    tokenizer: Tokenizer | None = None
    window: int = field(init=False)

    def __post_init__(self) -> None:
        if self.strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        object.__setattr__(self, "window", max((len(s.encode()) for s in self.strings), default=0) + WINDOW_MARGIN)

    def hit(self, generated: list[int]) -> bool:
        """Whether the newest token of ``generated`` (non-empty) ends the sequence."""
        if generated[-1] in self.ids:
            return True
        if not self.strings:
            return False
        text = self.tokenizer.decode(generated[-self.window:], skip_special_tokens=False)
        return any(s in text for s in self.strings)

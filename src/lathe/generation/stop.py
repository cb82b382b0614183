"""Stop strings (vLLM's `SamplingParams.stop`): a sequence finishes when its output text contains one.

Semantics, the same wherever lathe generates (the engine, `HFRollout`, `lathe generate`):

* Only the output is searched (never the prompt), decoded with `skip_special_tokens=True`.
* A stop string counts on the step whose token completes it: its match must end in text that the newest
  token added. Before `min_tokens` output tokens nothing counts (vLLM skips the check, and a match made
  then is never found later).
* The sequence finishes with reason "stop" and KEEPS the completing token: token ids and log-probs run up to
  and including it, so the trainer's tokens and log-probs match what was sampled. `lathe generate`'s text is
  cut just after the stop string (vLLM's `include_stop_str_in_output=True`): it ends with the stop string,
  even when the last token runs past it (stop "\\n" completed by a token "\\n\\n").

Cost, per sequence and step:
* Most tokens cannot end a stop string: the newest token's text must contain a stop string's last
  character. Which token ids may is decided once per id from its text alone (`StopStrings.may_end`) and
  then costs a dict look-up; only those tokens are decoded in context. A token whose own text holds an
  incomplete character (U+FFFD), and a leading space a decoder drops from a lone token, count as "may".
* A check decodes a tail window of the output, not all of it. A match ending in the newest token spans at
  most as many tokens as the stop string has UTF-8 bytes (every token adds at least one byte), so that many
  tokens plus a few (for a character split across tokens at the window's edge) always hold it. The
  window's start moves in jumps, so one check decodes at most `2 * window` tokens (twice after a skip).
  (Tokens that decode to nothing, such as skipped special tokens inside a stop string, could stretch a
  match past the window; no real stop string is made that way.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]

_SLACK_TOKENS = 4   # a UTF-8 character has at most 4 bytes, so at most 3 leading tokens decode to garbage


def check_stop_strings(stop: Sequence[str], who: str = "SamplingParams.stop") -> tuple[str, ...]:
    """The stop strings as a tuple, or a ValueError naming the bad entry."""
    if isinstance(stop, str):
        raise ValueError(f"{who}={stop!r} is a string; give a list of strings, e.g. [{stop!r}]")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{who}: entry {s!r} is not a non-empty string; every stop string needs text")
    return tuple(stop)


def text_decoder(tokenizer) -> Decode:
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=True)`, through the Rust backend when that
    is the same thing (the backend skips transformers' Python wrapper)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def decode_texts(tokenizer, rows: list[list[int]]) -> list[str]:
    """`tokenizer.decode(row, skip_special_tokens=True)` for every row; as one batch in the Rust backend (which
    spreads the rows over the CPU's cores) when that is the same thing, as in `text_decoder`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch(rows, skip_special_tokens=True)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b` (usually `b` simply extends `a`)."""
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_new_stop(text: str, num_old_chars: int, stop: Sequence[str]) -> int | None:
    """End offset in `text` of the earliest-ending stop string match that ends after `num_old_chars`
    (i.e. uses text the newest token added), or None."""
    best = None
    for s in stop:
        i = text.find(s, max(0, num_old_chars - len(s) + 1))
        if i >= 0 and (best is None or i + len(s) < best):
            best = i + len(s)
    return best


class StopStrings:
    """The stop strings of one generate call and how to decode; shared by its sequences' matchers.

    `token_filter=True` skips decoding after tokens that cannot end a stop string (module docstring); it
    assumes a decoder that only appends to earlier text (true of byte-level BPE, SentencePiece and char
    decoders; `from_tokenizer` turns it off when transformers' clean-up pass, which rewrites earlier text, runs).
    """

    def __init__(self, stop: Sequence[str], decode: Decode, *, token_filter: bool = False):
        self.stop = check_stop_strings(stop)
        if not self.stop:
            raise ValueError("StopStrings needs at least one stop string")
        self.decode = decode
        self.window = max(len(s.encode("utf-8")) for s in self.stop) + _SLACK_TOKENS
        self._last_chars = frozenset(s[-1] for s in self.stop)
        self._may_end: dict[int, bool] | None = {} if token_filter else None

    @classmethod
    def from_tokenizer(cls, stop: Sequence[str], tokenizer) -> "StopStrings":
        clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        return cls(stop, text_decoder(tokenizer), token_filter=not clean_up)

    def may_end(self, token_id: int) -> bool:
        """Whether `token_id`, appended to any text, can add the last character of a stop string."""
        if self._may_end is None:
            return True
        hit = self._may_end.get(token_id)
        if hit is None:
            piece = self.decode([token_id])
            hit = "\ufffd" in piece or not self._last_chars.isdisjoint(piece + " ")
            self._may_end[token_id] = hit
        return hit

    def matcher(self, *, min_tokens: int = 0, prompt_len: int = 0) -> "StopStringMatcher":
        return StopStringMatcher(self, min_tokens=min_tokens, prompt_len=prompt_len)


class StopStringMatcher:
    """Incremental stop-string check for one sequence; call `check` once after each appended token.

    `token_ids` passed to `check` is the sequence's whole token list; its first `prompt_len` ids are the
    prompt (not searched). State is one cached window of decoded text.
    """

    def __init__(self, stops: StopStrings, *, min_tokens: int = 0, prompt_len: int = 0):
        self.stops = stops
        self.min_tokens = min_tokens
        self.prompt_len = prompt_len
        self._start = prompt_len      # absolute index where the cached text begins
        self._seen = prompt_len       # absolute length of token_ids when `_text` was decoded
        self._text = ""               # decode(token_ids[_start:_seen])

    def check(self, token_ids: Sequence[int]) -> bool:
        """True when the newest token completes a stop string (and `min_tokens` are out)."""
        n = len(token_ids)
        if n - self.prompt_len < self.min_tokens or not self.stops.may_end(token_ids[-1]):
            return False
        decode, window = self.stops.decode, self.stops.window
        if n != self._seen + 1 or n - self._start > 2 * window:
            # tokens were skipped, or the window has grown: restart it `window` tokens back
            self._start = max(self.prompt_len, n - 1 - window)
            self._text = decode(token_ids[self._start:n - 1])
        text = decode(token_ids[self._start:n])
        old = common_prefix_len(self._text, text)
        self._text, self._seen = text, n
        return find_new_stop(text, old, self.stops.stop) is not None


def first_stop(output_ids: Sequence[int], stops: StopStrings, *, min_tokens: int = 0) -> int | None:
    """Number of output tokens up to and including the one that completes the first stop string, or None.

    The after-the-fact form of `StopStringMatcher` (for backends that generate first and cut later).
    """
    matcher = stops.matcher(min_tokens=min_tokens)
    ids: list[int] = []
    for tok in output_ids:
        ids.append(tok)
        if matcher.check(ids):
            return len(ids)
    return None


def stop_text(output_ids: Sequence[int], stop: Sequence[str], decode: Decode) -> str:
    """The output's text, cut just after the stop string its last token completed (whole text if none)."""
    text = decode(list(output_ids))
    if not stop or not output_ids:
        return text
    end = find_new_stop(text, common_prefix_len(decode(list(output_ids[:-1])), text), stop)
    return text if end is None else text[:end]

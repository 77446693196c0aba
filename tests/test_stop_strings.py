"""Stop strings cut the streamed text where the first one appears (before it, or after it where it is kept),
however the text is split into pieces, in time linear in the text."""
import random
import time

from distmk.serve.generation import StopStrings


def cut_at_first_stop(text: str, stops: list[str], kept=frozenset()) -> tuple[str, bool]:
    """The definition: the text before the stop string that ends first (the longest of those ending there), or
    through it where it is kept."""
    ends = [(i + len(s), -len(s)) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    if not ends:
        return text, False
    end, minus_len = min(ends)
    return text[:end] if text[end + minus_len:end] in kept else text[:end + minus_len], True


def feed_in_pieces(stops: list[str], text: str, rng: random.Random, kept=frozenset()) -> tuple[str, bool]:
    stopper, out, at = StopStrings(stops, kept), "", 0
    while True:
        piece = text[at:at + rng.randint(0, 3)]
        at += len(piece)
        sent, stopped = stopper.feed(piece, final=at >= len(text))
        out += sent
        if stopped or at >= len(text):
            return out, stopped


def test_pieces_of_any_size_cut_where_the_definition_does():
    rng = random.Random(0)
    for _ in range(5000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        kept = frozenset(s for s in stops if rng.random() < 0.5)       # vLLM's include_stop_str_in_output
        assert feed_in_pieces(stops, text, rng, kept) == cut_at_first_stop(text, stops, kept), (stops, text, kept)


def test_long_stop_strings_cost_linear_time():
    """Text that keeps almost completing four 1024-character stop strings, a character a token (the
    hold-back check was quadratic in the stop strings' length: minutes for this)."""
    stops = ["a" * 1023 + "b", "a" * 1023 + "c", "ab" * 512, "a" * 1024 + "d"]
    stopper = StopStrings(stops)
    t0 = time.perf_counter()
    sent = "".join(stopper.feed("a", final=False)[0] for _ in range(20000))
    assert time.perf_counter() - t0 < 2.0
    assert sent == "a" * (20000 - 1024) and stopper.feed("d", final=False) == ("", True)

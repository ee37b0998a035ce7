"""Text another user may have written, made safe to print; torch's refusals, without its
unsafe advice."""
from __future__ import annotations


def printable(text, limit: int = 300) -> str:
    """``text`` (any object: str() of it) with control and format characters escaped
    (``\\x1b``, ``\\u202e``), cut to ``limit`` characters."""
    s = text if isinstance(text, str) else str(text)
    if len(s) > limit:
        s = s[:limit] + "..."
    out = []
    for c in s:
        if c.isprintable():
            out.append(c)
        else:
            o = ord(c)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def torch_load_reason(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line, without torch's
    advice to re-run it with ``weights_only=False``: that would run whatever code the file
    holds, and zeroplug never does it."""
    text = str(exc)
    if "weights only load failed" in text.lower():
        # torch's message: the advice, then the reason, then a pointer to its docs
        detail = [p.strip() for p in text.split("\n\n") if p.strip() and "weights_only" not in p
                  and not p.strip().lower().startswith("weights only load failed")]
        reason = "it holds objects other than tensors and plain data, which zeroplug never loads"
        text = f"{reason} ({' '.join(detail)})" if detail else reason
    return printable(" ".join(text.split()), 500) or type(exc).__name__

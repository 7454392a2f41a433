"""math-verify in a child process, one JSON request per line on stdin, one JSON reply per line on stdout.

Run as a script (`python _math_worker.py`) by `rollout.rewards.math_verifier`, so it imports nothing of ours.
sympy can hang on inputs like 10^{10^{10}}; here math-verify's own signal-based timeouts work (main thread), and
the parent kills this process if a reply takes longer than its hard timeout.
"""

import json
import logging
import sys


def _as_latex(text: str) -> str:
    """math-verify only finds bare LaTeX (\\frac, \\sqrt) inside $...$ or \\boxed{}: wrap it."""
    if "\\" in text and "$" not in text and "\\boxed" not in text:
        return f"${text}$"
    return text


def main() -> None:
    logging.disable(logging.WARNING)  # math-verify logs every timeout; the parent reports failures
    from math_verify import parse, verify

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            timeout = int(request.get("timeout", 5))
            gold = parse(_as_latex(request["gold"]), parsing_timeout=timeout)
            pred = parse(_as_latex(request["pred"]), parsing_timeout=timeout)
            correct = bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
            reply = {"correct": correct, "pred_parsed": bool(pred), "gold_parsed": bool(gold)}
        except Exception as exc:  # a reply per request, whatever happens: the parent waits for one line
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

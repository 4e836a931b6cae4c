"""A tokenizer.json read in a child process of its own before the server reads it
(tokenizers.check_in_child runs this file as a script, so that it imports ``tokenizers`` and the
standard library only, never torch: a tenth of a second).

Hugging Face's tokenizers parse in Rust: ten million short pieces end the whole process in the
allocator's abort, a malformed normaliser or template in a panic, a backtracking pattern in a
hang. Here the strings are counted on the bytes first (an upper bound on the pieces and merges),
then the tokenizer built, its pieces counted and tried on a few texts, under an address-space and
a CPU-time limit: a crash, a hang or a refusal ends this process only. One JSON line on stdout says what was found:
{"refused": a sentence or null}.

    python tokenizer_check.py TOKENIZER_JSON LIMITS_JSON
"""
import json
import resource
import sys


def _refuse(sentence: str) -> None:
    print(json.dumps({"refused": sentence}), flush=True)
    sys.exit(0)


def check(path: str, limits: dict) -> None:
    with open(path, "rb") as file:
        text = file.read()
    # An upper bound on the pieces, merges and tokens it holds (each one string at least), counted
    # on the bytes before any parser allocates them.
    strings = (text.count(b'"') - text.count(b'\\"')) // 2
    if strings > limits["strings"]:
        _refuse(f"holds {strings:,} strings, more than any tokenizer we read ({limits['strings']:,})")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(text.decode("utf-8"))
        del text
        counts = {
            "pieces": tokenizer.get_vocab_size(with_added_tokens=False),
            "added tokens": len(tokenizer.get_added_tokens_decoder()),
        }
        for what, count in counts.items():
            if count > limits[what]:
                _refuse(f"holds {count:,} {what}, more than any tokenizer we read ({limits[what]:,})")
        for trial in limits["trials"]:
            tokenizer.encode(trial)
    except BaseException as error:  # a Rust panic (pyo3's PanicException) is a BaseException
        if isinstance(error, SystemExit):
            raise
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        _refuse(f"is not a tokenizer we can read ({reason})")
    print(json.dumps({"refused": None}), flush=True)


def main() -> None:
    path, limits = sys.argv[1], json.loads(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with open("/proc/self/status") as status:  # capped at what the interpreter holds now, plus the budget
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    for limit, value in ((resource.RLIMIT_AS, size + limits["bytes"]), (resource.RLIMIT_CPU, limits["seconds"])):
        hard = resource.getrlimit(limit)[1]  # never above what this process was given
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, hard))
    try:
        check(path, limits)
    except MemoryError:
        _refuse(f"needs more than {limits['bytes'] >> 20} MB to read, more than any tokenizer we read")
    except OSError:
        _refuse("could not be read")


if __name__ == "__main__":
    main()

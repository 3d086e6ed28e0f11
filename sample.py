"""Sample text from a trained checkpoint, or from GPT-2 itself imported from a local HF directory.

    python sample.py --ckpt out/                      # newest ckpt_*.pt in out/
    python sample.py --ckpt out/ckpt_0005000.pt --prompt "The meaning of life is" --top-p 0.95
    python sample.py --hf-dir ~/gpt2 --prompt-file prompt.txt --num-samples 3

With no prompt, samples start from <|endoftext|>, as GPT-2's unconditional samples do.
Generation uses a static KV cache and, on CUDA, a one-token step replayed as a CUDA graph
(--decode, gpt2_fused/training/generate.py); past block_size the context is cropped to the last
block_size tokens. A --ckpt directory whose newest checkpoint does not load falls back to the
one before it, naming the file it skipped.
The same --seed on the same device gives the same text. One sample is printed as its tokens
come; the speed goes to stderr at the end.
"""

import codecs
import functools
import sys
import time
from pathlib import Path

import torch

from gpt2_fused.training import cli, generate, model_io
from gpt2_fused.training.errors import UsageError, run_main
from gpt2_fused.training.hardware import DTYPES, pick_device, resolve_dtype


# errors the user can fix: one line each (gpt2_fused/training/errors.py), the path named
def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="checkpoint file, or an out_dir (its newest ckpt_*.pt)")
    src.add_argument("--hf-dir", help="local HF GPT-2 directory (config.json + weights)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text to continue (default: <|endoftext|>)")
    prompt.add_argument("--prompt-file", help="file whose text (UTF-8) to continue")
    p.add_argument("--num-samples", type=int, default=5, help="samples, one batch")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200, help="0 = off")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, e.g. 0.95")
    p.add_argument("--seed", type=int, default=1337, help="the sampling RNG's seed")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto: bfloat16 on a GPU that has it, else float32",
    )
    p.add_argument(
        "--decode",
        default="auto",
        choices=["auto", *generate.MODES],
        help="auto: graph on CUDA, eager on CPU (gpt2_fused/training/generate.py)",
    )
    args = p.parse_args(argv)
    if args.num_samples < 1:
        p.error(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        p.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        p.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        p.error(f"--prompt-file {args.prompt_file} does not exist")
    return args


def main(argv=None):
    args = parse_args(argv)
    from data.tokenizer import EOT, get_tokenizer

    try:
        device = pick_device(args.device)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None
    text = args.prompt
    if args.prompt_file is not None:  # before the model: a bad file fails fast
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--prompt-file {args.prompt_file} is not UTF-8 text ({e})") from None
    if args.decode == "graph" and device.type != "cuda":  # before the model: fails fast
        raise UsageError(
            f"--decode graph captures a CUDA graph: not on {device}; use --decode eager"
        )
    dtype = resolve_dtype(args.dtype, device)
    say = functools.partial(print, file=sys.stderr)  # stdout is the samples'
    model = model_io.load_model(args.ckpt, args.hf_dir, device, dtype, say=say)
    enc = get_tokenizer()

    ids = enc.encode(text, allowed_special={"<|endoftext|>"}) if text else []
    start = 0 if ids else 1  # an <|endoftext|> we put there ourselves is not printed
    ids = ids or [EOT]
    if max(ids) >= model.config.vocab_size:
        what = "<|endoftext|> (the default prompt)" if ids == [EOT] else "the prompt's token id"
        raise UsageError(
            f"{what} {max(ids)} is past the model's vocab_size={model.config.vocab_size}: give a "
            f"--prompt whose GPT-2 token ids are all below {model.config.vocab_size}"
        )

    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    stream = Stream(enc) if args.num_samples == 1 else None
    if stream is not None:
        stream.write(ids[start:])
    times = []  # when the first token was in

    def on_token(col):
        if stream is not None:
            stream.push(col)
        if not times:
            sync(device)
            times.append(time.perf_counter())

    if args.decode == "compile":  # the first token waits for torch.compile: seconds of silence
        print("compiling the decoding step before the first token...", file=sys.stderr)
    t0 = time.perf_counter()
    out = generate.generate(
        model,
        idx,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        generator=generator,
        decode=args.decode,
        on_token=on_token,
    )
    sync(device)
    t1 = time.perf_counter()
    if stream is not None:
        stream.close()
        print("-" * 40)
    else:
        for row in out.tolist():
            print(enc.decode(row[start:]))
            print("-" * 40)
    sys.stdout.flush()
    first = times[0] if times else t1
    print(speed(args.num_samples, args.max_new_tokens, t0, first, t1), file=sys.stderr)
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed(batch, new_tokens, t0, first, end):
    """A line on the speed: time to the first token (its prefill, and the compile or graph
    capture of a first call), then tokens per second over the batch."""
    if new_tokens == 0:
        return "no tokens generated"
    line = f"{batch} x {new_tokens} tokens in {end - t0:.2f} s: first after {first - t0:.2f} s"
    if new_tokens > 1:
        line += f", then {batch * (new_tokens - 1) / (end - first):,.0f} tok/s"
    return line


class Stream:
    """One sample's text to stdout as its tokens arrive. A character whose UTF-8 bytes are split
    across tokens is written once its last byte is in (an incremental decoder over the tokens'
    bytes), so the text ends up exactly enc.decode(ids) (errors="replace", as tiktoken's)."""

    def __init__(self, enc):
        self.enc = enc
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = []  # (ids copied to the host, the event that marks the copy done)

    def push(self, col):
        """Queue the copy of a new (1,) column from the device and write the one before it,
        done by now: waiting for the newest would leave the GPU idle while the host launches
        the next step."""
        event = None
        if col.is_cuda:
            col = col.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending.append((col, event))
        while len(self.pending) > 1:
            self._write_oldest()

    def _write_oldest(self):
        ids, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        self.write(ids.tolist())

    def write(self, ids):
        data = b"".join(self.enc.decode_single_token_bytes(i) for i in ids)
        sys.stdout.write(self.utf8.decode(data))
        sys.stdout.flush()

    def close(self):
        while self.pending:
            self._write_oldest()
        sys.stdout.write(self.utf8.decode(b"", final=True) + "\n")


if __name__ == "__main__":
    run_main(main, model_io.USER_ERRORS)

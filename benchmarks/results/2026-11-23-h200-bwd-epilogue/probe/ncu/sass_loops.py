"""Compare the consumers' main loops of two sm_90 builds of the backward (SASS from benchmarks.hopper_build --sass):
in each, the two shortest disjoint loops (a backward branch over a span) with 16 or more HGMMAs; their instruction
counts, how alike their op sequences are (registers and constants ignored) and which ops differ in number.

    python3 sass_loops.py A.sass B.sass
"""
import difflib
import re
import sys
from collections import Counter


def parse(path):
    """-> [(address, instruction text)]"""
    ins = []
    for line in open(path).read().splitlines():
        m = re.match(r'\s+/\*([0-9a-f]{4})\*/\s+(.*?)\s*;', line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return ins


def main_loops(ins):
    """the two shortest disjoint loops with a tile's products in them (16 or more HGMMAs: the consumers' loops over
    query tiles), in address order, as instruction lists"""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r'BRA (?:`\()?(0x[0-9a-f]+)', t)
        if m and int(m.group(1), 16) < a:
            start = index[int(m.group(1), 16)]
            if sum("HGMMA" in text for _, text in ins[start:i + 1]) >= 16:  # a tile's five products
                loops.append((i - start, start, i))
    chosen = []
    for length, start, end in sorted(loops):
        if len(chosen) < 2 and all(end < s or start > e for s, e in chosen):
            chosen.append((start, end))
    return [[text for _, text in ins[start:end + 1]] for start, end in sorted(chosen)]


def shape(t):
    return re.sub(r'0x[0-9a-f]+', 'X', re.sub(r'\bU?P\d\b', 'P', re.sub(r'\bU?R\d+\b', 'R', t)))


def op(t):
    return re.sub(r'^@!?U?P\d\s+', '', t).split()[0]


a_loops, b_loops = (main_loops(parse(path)) for path in sys.argv[1:3])
for n, (a, b) in enumerate(zip(a_loops, b_loops)):
    ratio = difflib.SequenceMatcher(None, [shape(t) for t in a], [shape(t) for t in b], autojunk=False).ratio()
    ca, cb = Counter(map(op, a)), Counter(map(op, b))
    print(f"loop {n}: {len(a)} vs {len(b)} instructions, {sum('HGMMA' in t for t in a)} HGMMA, "
          f"op-sequence similarity {ratio:.3f}; ops differing in number: "
          f"{ {k: (ca[k], cb[k]) for k in sorted(set(ca) | set(cb)) if ca[k] != cb[k]} }")

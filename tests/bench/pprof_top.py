"""Reads a Go pprof CPU profile (gzipped profile.proto) and prints the top
functions by flat and cumulative samples. A minimal protobuf reader."""
import gzip, sys, collections

def varint(b, i):
    r = s = 0
    while True:
        c = b[i]; i += 1
        r |= (c & 0x7f) << s; s += 7
        if c < 0x80: return r, i

def fields(b):
    i = 0
    while i < len(b):
        key, i = varint(b, i)
        f, t = key >> 3, key & 7
        if t == 0:
            v, i = varint(b, i)
        elif t == 2:
            n, i = varint(b, i); v = b[i:i+n]; i += n
        elif t == 1:
            v = b[i:i+8]; i += 8
        elif t == 5:
            v = b[i:i+4]; i += 4
        else:
            raise ValueError(t)
        yield f, t, v

def packed(v, t):
    if t == 0: return [v]
    out = []; i = 0
    while i < len(v):
        x, i = varint(v, i); out.append(x)
    return out

data = gzip.decompress(open(sys.argv[1], 'rb').read())
strings = []; samples = []; locs = {}; funcs = {}
for f, t, v in fields(data):
    if f == 6: strings.append(v.decode('utf-8', 'replace'))
    elif f == 2:
        ids = []; vals = []
        for g, tt, vv in fields(v):
            if g == 1: ids += packed(vv, tt)
            elif g == 2: vals += packed(vv, tt)
        samples.append((ids, vals))
    elif f == 4:
        lid = 0; fns = []
        for g, tt, vv in fields(v):
            if g == 1: lid = vv
            elif g == 4:
                for h, t3, v3 in fields(vv):
                    if h == 1: fns.append(v3)
        locs[lid] = fns
    elif f == 5:
        fid = 0; name = 0
        for g, tt, vv in fields(v):
            if g == 1: fid = vv
            elif g == 2: name = vv
        funcs[fid] = name
flat = collections.Counter(); cum = collections.Counter(); total = 0
for ids, vals in samples:
    w = vals[-1] if vals else 1
    total += w
    names = [strings[funcs[fn]] for lid in ids for fn in locs.get(lid, [])]
    if names: flat[names[0]] += w
    for n in set(names): cum[n] += w
print(f"total {total/1e9:.2f} s of CPU in the profile")
print("--- flat")
for n, w in flat.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
    print(f"{100*w/total:5.1f}%  {n}")
print("--- cumulative")
for n, w in cum.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 45):
    print(f"{100*w/total:5.1f}%  {n}")

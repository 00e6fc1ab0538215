#!/usr/bin/env python3
"""Extracts Jane Austen's six novels from Debian's r-cran-janeaustenr package as plain text.

The package stores each novel as an R character vector (one element per line) in an R
lazy-load database (data/Rdata.rdx + Rdata.rdb). This reads that format with the standard
library only: the index is a gzip'd serialized R list naming (offset, length) pairs into
the .rdb file, each entry being a 4-byte length plus a zlib stream of one serialized object.

usage: austen_from_r.py <janeaustenr data dir> <output dir>
"""
import gzip
import os
import struct
import sys
import zlib

NOVELS = ["sensesensibility", "prideprejudice", "mansfieldpark",
          "emma", "northangerabbey", "persuasion"]


class RReader:
    """Reads R's XDR serialization format (versions 2 and 3), enough for data objects."""

    def __init__(self, data):
        self.data, self.pos, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR-serialized R object")
        self.pos = 2
        version = self.int()
        self.int(), self.int()  # writer and minimal reader R versions
        if version == 3:
            n = self.int()  # length of the native encoding name that follows
            self.pos += n

    def int(self):
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def read(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242, 251, 253):  # NILVALUE, EMPTYENV, MISSINGARG, GLOBALENV
            return None
        if kind == 255:  # REFSXP
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # SYMSXP
            sym = self.read()
            self.refs.append(sym)
            return sym
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return s
        if kind in (2, 6):  # LISTSXP pairlist: attributes, tag, car, cdr
            out = {}
            while True:
                if has_attr:
                    self.read()
                tag = self.read() if has_tag else None
                out[tag if tag is not None else len(out)] = self.read()
                nxt = self.int()
                kind, has_attr, has_tag = nxt & 0xFF, nxt & (1 << 9), nxt & (1 << 10)
                if kind != 2:
                    return out
        if kind == 16:  # STRSXP
            value = [self.read() for _ in range(self.int())]
        elif kind == 19:  # VECSXP
            value = [self.read() for _ in range(self.int())]
        elif kind in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"unsupported R type {kind} at byte {self.pos}")
        if has_attr:
            attrs = self.read()
            if isinstance(attrs, dict) and "names" in attrs:
                return dict(zip(attrs["names"], value))
        return value


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    with gzip.open(os.path.join(src, "Rdata.rdx")) as f:
        index = RReader(f.read()).read()
    variables = index["variables"]
    with open(os.path.join(src, "Rdata.rdb"), "rb") as f:
        db = f.read()
    os.makedirs(dst, exist_ok=True)
    for name in NOVELS:
        offset, length = variables[name]
        blob = db[offset:offset + length]
        lines = RReader(zlib.decompress(blob[4:])).read()
        text = "\n".join(line or "" for line in lines) + "\n"
        with open(os.path.join(dst, name + ".txt"), "w", encoding="utf-8") as out:
            out.write(text)
        print(f"{name}: {len(lines)} lines, {len(text)} characters")


if __name__ == "__main__":
    main()

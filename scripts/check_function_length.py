#!/usr/bin/env python3
"""Lists the functions of the given folders longer than --max lines (100 by default).

A function is a brace block opened at the end of a line that ends a signature (`) {`,
`) const {`, `) override {`, `) -> T {`, ...) at namespace or class level; its length
counts from the signature's line to the closing brace. Lambdas inside a function count
toward it. Exits 1 when any is too long. Usage: check_function_length.py [--max N] DIR...
"""
import argparse
import os
import re
import sys

OPENER = re.compile(r'\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(final\s*)?(->\s*[\w:<>, *&]+\s*)?'
                    r'(ABSL_[A-Z_]+\([^)]*\)\s*)*\{\s*(//.*)?$')
CONTROL = re.compile(r'^\s*(\}\s*)?(if|for|while|switch|catch|else if)\b')


def strip(line):
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split('//', 1)[0] if '//' in line and not OPENER.search(line) else line


def long_functions(path, limit):
    found = []
    with open(path, encoding='utf-8', errors='replace') as f:
        lines = f.read().split('\n')
    depth = 0
    start = None  # (line index, depth at open)
    for i, raw in enumerate(lines):
        line = strip(raw)
        if start is None and OPENER.search(line) and not CONTROL.match(line) and depth <= 3:
            # Walk back to the signature's first line (a line after a blank, ';', '}' or '{').
            j = i
            while j > 0 and lines[j - 1].strip() and not lines[j - 1].rstrip().endswith((';', '}', '{', ':')) \
                    and not lines[j - 1].lstrip().startswith(('//', '#')):
                j -= 1
            start = (j, depth)
        depth += line.count('{') - line.count('}')
        if start is not None and depth <= start[1]:
            length = i - start[0] + 1
            if length > limit:
                name = lines[start[0]].strip()[:90]
                found.append((length, f'{path}:{start[0] + 1}: {length} lines: {name}'))
            start = None
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--max', type=int, default=100)
    parser.add_argument('dirs', nargs='+')
    args = parser.parse_args()
    found = []
    for top in args.dirs:
        for dirpath, _, names in os.walk(top):
            for name in sorted(names):
                if name.endswith(('.cc', '.h', '.cu')):
                    found.extend(long_functions(os.path.join(dirpath, name), args.max))
    for _, line in sorted(found, reverse=True):
        print(line)
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())

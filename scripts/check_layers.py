#!/usr/bin/env python3
"""Refuses an include that goes up the layers (docs/ARCHITECTURE.md).

Two tables are checked:
  - the tree's folders (DESIGN.md): proto/ includes nothing of ours, kernels/ only
    kernels/, cache_manager/ only itself and kernels/ (and never gRPC or protobuf),
    wire/ (the enums' translation) proto/ and kernels/, server/ anything but clients/;
  - the layers of cache_manager/, as its CMakeLists.txt declares them (the build writes
    them to --layers, one "name: dependencies" line each): a file of a layer includes
    files of its own layer and of the layers it depends on, directly or through others.

Prints one line per wrong include (file:line, what it includes, what is allowed) and
exits 1 when there is any; the build runs it before compiling a layer.
"""
import argparse
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
IMPORT = re.compile(r'^\s*import\s+"([^"]+)"')  # .proto
OURS = ('proto/', 'kernels/', 'cache_manager/', 'server/', 'clients/', 'wire/')

# folder -> folders of ours it may include (besides itself)
FOLDERS = {
    'proto': (),
    'kernels': (),
    'cache_manager': ('kernels',),
    'wire': ('kernels', 'proto'),
    'server': ('cache_manager', 'kernels', 'proto', 'wire'),
}
# Headers cache_manager/ and kernels/ must never see: the engine knows nothing of the wire.
WIRE = ('grpc', 'grpcpp/', 'google/protobuf/')


def read_layers(path):
    deps = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            name, _, rest = line.partition(':')
            deps[name.strip()] = rest.split()
    return deps


def closure(deps):
    below = {}

    def walk(name, seen):
        for dep in deps.get(name, ()):
            if dep not in seen:
                seen.add(dep)
                walk(dep, seen)
        return seen

    for name in deps:
        below[name] = walk(name, set())
    return below


def folder_of(path):
    return path.split('/', 1)[0]


def layer_of(path):
    """'cache_manager/kv/block_pool.h' -> 'kv'; None for a file not in a layer folder."""
    parts = path.split('/')
    return parts[1] if len(parts) > 2 else None


def check_file(rel, text, layers, below):
    errors = []
    top = folder_of(rel)
    pattern = IMPORT if rel.endswith('.proto') else INCLUDE
    if top == 'cache_manager' and rel.count('/') == 1 and not rel.endswith('CMakeLists.txt'):
        errors.append(f'{rel}: every file of cache_manager/ belongs to a layer folder')
    for number, line in enumerate(text.splitlines(), 1):
        m = pattern.match(line)
        if not m:
            continue
        target = m.group(1)
        where = f'{rel}:{number}: includes {target}'
        if top in ('cache_manager', 'kernels') and target.startswith(WIRE):
            errors.append(f'{where}: {top}/ knows nothing of gRPC or protobuf')
            continue
        if not target.startswith(OURS):
            continue
        target_top = folder_of(target)
        if target_top != top and target_top not in FOLDERS.get(top, ()):
            allowed = ', '.join(f + '/' for f in FOLDERS.get(top, ())) or 'nothing of ours'
            errors.append(f'{where}: {top}/ may include {allowed} besides itself')
            continue
        if top == 'cache_manager' and target_top == 'cache_manager':
            mine, theirs = layer_of(rel), layer_of(target)
            if mine is None or theirs is None or mine == theirs:
                continue
            if mine not in layers:
                errors.append(f'{where}: {mine}/ is not a layer of cache_manager/CMakeLists.txt')
            elif theirs not in below[mine]:
                allowed = ', '.join(sorted(below[mine])) or 'no other layer'
                errors.append(f'{where}: layer {mine} is not above {theirs} '
                              f'(it may use {allowed}; cache_manager/CMakeLists.txt)')
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--root', required=True, help='the repository root')
    parser.add_argument('--layers', required=True, help='"name: deps" lines, from the build')
    args = parser.parse_args()
    layers = read_layers(args.layers)
    below = closure(layers)
    errors = []
    for top in FOLDERS:
        for dirpath, _, names in os.walk(os.path.join(args.root, top)):
            for name in sorted(names):
                if not name.endswith(('.h', '.cc', '.cu', '.cuh', '.proto')):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, args.root).replace(os.sep, '/')
                if '/gen/' in rel:
                    continue
                with open(path, encoding='utf-8', errors='replace') as f:
                    errors.extend(check_file(rel, f.read(), layers, below))
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f'check_layers: {len(errors)} include(s) against the layers', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())

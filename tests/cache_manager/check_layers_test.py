#!/usr/bin/env python3
"""scripts/check_layers.py passes the tree as it is and refuses each kind of wrong include
planted in a copy of it. Usage: check_layers_test.py REPO_ROOT LAYERS_FILE"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT, LAYERS = sys.argv[1], sys.argv[2]
CHECK = os.path.join(ROOT, 'scripts', 'check_layers.py')


def run_check(root):
    return subprocess.run([sys.executable, CHECK, '--root', root, '--layers', LAYERS],
                          capture_output=True, text=True)


class CheckLayersTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='check-layers-')
        for folder in ('cache_manager', 'kernels', 'proto', 'server', 'wire'):
            shutil.copytree(os.path.join(ROOT, folder), os.path.join(self.tmp, folder),
                            ignore=shutil.ignore_patterns('gen'))

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def plant(self, rel, include):
        path = os.path.join(self.tmp, rel)
        with open(path) as f:
            lines = f.read().split('\n')
        # After the first include, so the line number is known.
        at = next(i for i, line in enumerate(lines) if line.startswith('#include'))
        lines.insert(at + 1, f'#include "{include}"')
        with open(path, 'w') as f:
            f.write('\n'.join(lines))
        return at + 2

    def test_the_tree_as_it_is_passes(self):
        result = run_check(ROOT)
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_kv_including_the_engine_fails_naming_the_line(self):
        line = self.plant('cache_manager/kv/kv_pools.h', 'cache_manager/engine/sequence.h')
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1)
        self.assertIn(f'cache_manager/kv/kv_pools.h:{line}: includes cache_manager/engine/sequence.h',
                      result.stderr)
        self.assertIn('layer kv is not above engine', result.stderr)

    def test_a_lower_layer_including_the_table_fails(self):
        self.plant('cache_manager/engine/sequence.cc', 'cache_manager/table/sequence_table.h')
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1)
        self.assertIn('layer engine is not above table', result.stderr)

    def test_a_layer_may_include_one_it_reaches_through_another(self):
        # table -> tp -> engine -> policy: table may include policy/ directly.
        self.plant('cache_manager/table/step_executor.cc', 'cache_manager/policy/policy.h')
        self.assertEqual(run_check(self.tmp).returncode, 0)

    def test_the_engine_including_grpc_fails(self):
        self.plant('cache_manager/engine/sequence.cc', 'grpcpp/grpcpp.h')
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1)
        self.assertIn('knows nothing of gRPC or protobuf', result.stderr)

    def test_the_engine_including_the_server_fails(self):
        self.plant('cache_manager/base/clock.cc', 'server/daemon.h')
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1)
        self.assertIn('cache_manager/ may include kernels/ besides itself', result.stderr)

    def test_kernels_including_the_engine_fails(self):
        self.plant('kernels/score_matrix.cc', 'cache_manager/base/check.h')
        self.assertEqual(run_check(self.tmp).returncode, 1)

    def test_a_file_outside_the_layer_folders_fails(self):
        with open(os.path.join(self.tmp, 'cache_manager', 'loose.h'), 'w') as f:
            f.write('#pragma once\n')
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1)
        self.assertIn('cache_manager/loose.h: every file of cache_manager/ belongs to a layer',
                      result.stderr)


if __name__ == '__main__':
    unittest.main(argv=sys.argv[:1], verbosity=2)

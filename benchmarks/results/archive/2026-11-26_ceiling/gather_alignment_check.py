"""The 2026-11-27 06:33 run's check (README.md): compiled variants of gather_rows's kernel for counts at
every alignment. Usage, on a GPU: python3 gather_alignment_check.py PATH/TO/gather_rows.py"""
import importlib.util, sys, torch
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("g", path); g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
src = torch.randn(64, 4, 128, dtype=torch.bfloat16, device="cuda")
perm = torch.randint(0, 64, (32,), dtype=torch.int32, device="cuda")
counts = torch.tensor([5, 7, 9, 11, 13], dtype=torch.int32, device="cuda")
out = torch.zeros(32, 4, 128, dtype=torch.bfloat16, device="cuda")
g.gather_rows(src, perm, counts[1:2], out)
cache = g._gather_rows_kernel.device_caches[torch.cuda.current_device()][0]
n0 = len(cache)
for i in range(5):
    g.gather_rows(src, perm, counts[i:i+1], out)
print(path, "compiled variants after an unaligned count:", n0, "after counts at every alignment:", len(cache))

"""Turn chapter 7 into a plain script for the GPU-size run (the GPU machine has no Jupyter).

Usage: python benchmarks/ch7_gpu/make_script.py /tmp/ch7.py; then see README.md beside this file.
"""
import json, sys
nb = json.load(open('book/07_capstone_vit_sharpness.ipynb'))
out = ['import os, sys, time as _t, json as _json', '_T0 = _t.perf_counter()',
       'def _mark(i):', '    print(f"\\n##### cell {i}  t = {_t.perf_counter() - _T0:.1f} s", flush=True)']
for i, c in enumerate(nb['cells']):
    if c['cell_type'] != 'code':
        continue
    s = ''.join(c['source'])
    if 'google.colab' in s:
        continue
    if i == 2:
        assert 'SIZE = "cpu"\n' in s
        s = s.replace('SIZE = "cpu"\n', 'SIZE = os.environ.get("CH7_SIZE", "cpu")\n')
        s += '\nexec(os.environ.get("CH7_OVERRIDE", ""))\nprint("SIZE", SIZE, "N_ITER", N_ITER, "B32", B32_BATCHES, B32_BATCH, B32_ITER, "seeds", PRE_SEEDS, FAMILY_SEEDS)\nprint("devices", jax.devices(), "| x64", jax.config.jax_enable_x64, "| default matmul precision", jax.config.jax_default_matmul_precision)\n'
    if 'CHECKPOINTS = []' in s:
        assert 'have_torch = ' in s
        s = s.replace('have_torch = ', 'if os.environ.get("CH7_HOOK"): exec(open(os.environ["CH7_HOOK"]).read())\nhave_torch = ')
    out.append(f'_mark({i})')
    out.append(s)
out.append('_mark("end")')
out.append('''
from matplotlib.backends.backend_pdf import PdfPages
with PdfPages(os.path.join(os.environ.get("OUT", "."), "ch7_figures.pdf")) as pdf:
    for n in plt.get_fignums():
        pdf.savefig(plt.figure(n))
print("figures saved", len(plt.get_fignums()))
''')
open(sys.argv[1], 'w').write('\n'.join(out) + '\n')

#!/bin/bash
# Regenerates (from the repository root, after cargo build --release -p warden-cli) docs/goodput.md's "The heal in the plan" rows.
W=${W:-target/release/warden}
row(){ label="$1"; shift; timeout 600 $W goodput plan --json --reps 1000 --seed 1 "$@" 2>/dev/null | python3 -c "
import json,sys
d=json.load(sys.stdin); w=d['warden']['optimum']; b=d['baseline']['optimum']
iv=w['interval_s']
ivs = f'{iv:.1f} s' if iv<60 else f'{iv/60:.1f} min'
print(f\"| $label | {w['goodput']['mean']*100:.2f}% | {w['breakdown']['lost']*100:.2f}% | {w['breakdown']['restart']*100:.2f}% | {ivs} | {b['goodput']['mean']*100:.2f}% |\")
"; }
H="--heal-s 0.27 --heal-across-hosts"
row "Llama 3, 16,384 GPUs, no heal" --preset llama3
row "Llama 3, \`--heal-s 0.27\`" --preset llama3 --heal-s 0.27
row "Llama 3, \`--heal-s 0.27 --heal-across-hosts\`" --preset llama3 $H
row "Llama 3, 8 spares" --preset llama3 --spares 8
row "Llama 3, 8 spares, \`--heal-s 0.27 --heal-across-hosts\`" --preset llama3 --spares 8 $H
row "Llama 3, a 10 s synchronous save, 8 spares" --preset llama3 --save-stall 10 --spares 8
row "the same, \`--heal-s 0.27 --heal-across-hosts\`" --preset llama3 --save-stall 10 --spares 8 $H
row "100,000 GPUs, no heal" --preset llama3 --gpus 100000
row "100,000 GPUs, a 10 s save, 8 spares" --preset llama3 --gpus 100000 --save-stall 10 --spares 8
row "the same, \`--heal-s 0.27 --heal-across-hosts\`" --preset llama3 --gpus 100000 --save-stall 10 --spares 8 $H

#!/usr/bin/env bash
# One device call on the lent H200: tctune's own runs plus the pass benchmarks, every baseline measured in the
# same call. Usage there (after installing the wheels, see benchmarks/NOTES.md):
#   OUT=/some/dir bash benchmarks/run_h200.sh [part...]
#   parts: optimize fusion train pareto backend padding suite suite_a suite_b suite_c suite_fp8 optimize_default suite_conv backend_compile suite_backend suite_final suite_gpt2_fp8 optimize_fp8 aoti suite_opt_a suite_opt_b suite_opt_c
#   (suite: every model, --quick; suite_a / suite_b: GPT-2 + BERT-base / BERT-large + ResNet-50 + seed CNN with
#   every torch.compile variant, one device call each)
# Each step has its own time limit so one slow step cannot cost the others; logs and JSON go to $OUT, and
# everything is packed into $OUT/results.tar.gz (the device returns at most 8 files).
set -u
OUT=${OUT:?set OUT}
parts=${*:-optimize fusion train pareto}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > "$OUT/r/gpu.csv" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" > "$OUT/r/versions.txt" 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/r/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/r/steps.txt"; }
for p in $parts; do case $p in
  optimize) step optimize_bert_base 240 python3 -m tctune optimize recipes/bert_base.py --out "$OUT/r/bert_base" \
              --runtimes eager,cudagraphs --trials 16 --quiet ;;
  fusion)   step bench_fusion 150 python3 benchmarks/bench_fusion.py --out "$OUT/r/bench_fusion.json" ;;
  train)    step train_seed_cnn 90 python3 -m tctune optimize recipes/seed_cnn.py --mode train --out "$OUT/r/seed_cnn_train" \
              --batch-sizes 256,1024 --runtimes eager --trials 8 --quiet ;;
  pareto)   step pareto_bert_base 120 python3 -m tctune optimize recipes/bert_base.py --objective pareto --out "$OUT/r/bert_base_pareto" \
              --batch-sizes 8,32,128 --runtimes eager,cudagraphs --trials 12 --no-export --quiet ;;
  backend)  step bench_backend 280 python3 benchmarks/bench_backend.py --out "$OUT/r/bench_backend.json" ;;
  padding)  step bench_padding 150 python3 benchmarks/bench_padding.py --out "$OUT/r/bench_padding.json" --budget 135 ;;
  suite)    step suite 420 python3 benchmarks/suite.py --out "$OUT/r/suite" --quick ;;
  suite_a)  step suite_a 325 python3 benchmarks/suite.py --out "$OUT/r/suite_a" --models gpt2,bert_base \
              --budget 310 --model-limit 155 --compile-budget 90 ;;
  suite_b)  step suite_b 400 python3 benchmarks/suite.py --out "$OUT/r/suite_b" --models bert_large,resnet50,seed_cnn \
              --budget 385 --model-limit 175 --compile-budget 110 ;;
  suite_c)  step suite_c 500 python3 benchmarks/suite.py --out "$OUT/r/suite_c" --models gpt2,resnet50,bert_large,seed_cnn \
              --budget 480 --model-limit 140 --compile-budget 80 --policies pure ;;
  suite_fp8) step suite_fp8 330 python3 benchmarks/suite.py --out "$OUT/r/suite_fp8" --models bert_base,bert_large \
              --budget 320 --model-limit 175 --compile-budget 70 \
              --variants 'fp16_eager,fp16_compile,fp8_torchao_compile,tctune_fp16_pure_inductor_cudagraphs,tctune_fp8*,tctune_compile_fp16_pure' ;;
  optimize_default) step optimize_bert_base_default 330 python3 -m tctune optimize recipes/bert_base.py \
              --out "$OUT/r/bert_base_default" --quiet ;;
  suite_conv) step suite_conv 200 python3 benchmarks/suite.py --out "$OUT/r/suite_conv" --models resnet50,seed_cnn \
              --budget 190 --model-limit 120 --compile-budget 70 \
              --variants 'fp16_eager,fp16_compile,tctune_fp16_pure_cudagraphs,tctune_fp16_pure_inductor*,tctune_compile_fp16_pure' ;;
  backend_compile) step backend_compile 200 python3 benchmarks/bench_backend_compile.py --device cuda --model gpt2 \
              --batch 32 --seq 512 --precision fp16 --caches off --json "$OUT/r/backend_compile_gpt2.json" ;;
  suite_backend) step suite_backend 300 python3 benchmarks/suite.py --out "$OUT/r/suite_backend" --models gpt2,bert_large \
              --budget 290 --model-limit 150 --compile-budget 110 \
              --variants 'fp16_eager,fp16_compile,tctune_fp16_pure_inductor_cudagraphs,tctune_compile_fp16_pure' ;;
  suite_final) step suite_final 470 python3 benchmarks/suite.py --out "$OUT/r/suite_final" --models gpt2,bert_base,bert_large \
              --budget 460 --model-limit 175 --compile-budget 90 \
              --variants 'fp16_eager,fp16_compile,fp16_compile_fp32_out,tctune_fp16_pure_inductor_cudagraphs,tctune_fp8keep*,tctune_fp8plan*,tctune_compile_fp16_pure' ;;
  suite_gpt2_fp8) step suite_gpt2_fp8 200 python3 benchmarks/suite.py --out "$OUT/r/suite_gpt2_fp8" --models gpt2 \
              --budget 190 --model-limit 180 --compile-budget 90 \
              --variants 'fp16_eager,fp16_compile,fp16_compile_fp32_out,tctune_fp16_pure_inductor_cudagraphs,tctune_fp8*' ;;
  optimize_fp8) step optimize_bert_base_fp8 260 python3 -m tctune optimize recipes/bert_base.py \
              --out "$OUT/r/bert_base_b64" --batch-sizes 64 --runtimes eager,inductor-cudagraphs --trials 40 \
              --timeout 200 --no-export --quiet
              step suite_bert_base_baselines 90 python3 benchmarks/suite.py --out "$OUT/r/suite_bert_base_baselines" \
              --models bert_base --budget 80 --variants 'fp16_eager,fp16_compile' ;;
  suite_opt_a) step suite_opt_a 500 python3 benchmarks/suite.py --out "$OUT/r/suite_opt_a" --models gpt2,resnet50,seed_cnn \
              --budget 480 --model-limit gpt2=225,resnet50=170,seed_cnn=80 --compile-budget 90 --optimize-budget 110 \
              --variants 'fp32_eager,tf32_eager,autocast_bf16,fp16_eager,fp16_compile,fp16_compile_fp32_out,tctune_fp16_pure_inductor_cudagraphs,tctune_fp8plan*,tctune_optimize' ;;
  suite_opt_b) step suite_opt_b 520 python3 benchmarks/suite.py --out "$OUT/r/suite_opt_b" --models bert_base,bert_large \
              --budget 500 --model-limit bert_base=200,bert_large=295 --compile-budget 90 --optimize-budget 150 \
              --variants 'fp32_eager,tf32_eager,autocast_bf16,fp16_eager,fp16_compile,fp16_compile_fp32_out,tctune_fp16_pure_inductor_cudagraphs,tctune_fp8keep*,tctune_optimize' ;;
  suite_opt_c) step suite_opt_c 470 python3 benchmarks/suite.py --out "$OUT/r/suite_opt_c" --models bert_base,gpt2 \
              --budget 455 --model-limit bert_base=215,gpt2=235 --compile-budget 90 --optimize-budget 140 \
              --variants 'fp32_eager,tf32_eager,autocast_bf16,fp16_eager,fp16_compile,fp16_compile_fp32_out,tctune_fp16_pure_inductor_cudagraphs,tctune_fp8plan*,tctune_optimize' ;;
  aoti)     step bench_aoti 200 python3 benchmarks/bench_aoti.py --out "$OUT/r/aoti" --bert-timeout 150 ;;
esac; done
find "$OUT/r" \( -name '*.onnx' -o -name '*.onnx.data' -o -name 'study.db' -o -name '*.pt2' \) -delete
for f in "$OUT"/r/*/report.md; do echo "== $f"; grep -E "^Best:|^- Against|keep FP32" "$f"; done
for f in "$OUT"/r/bench_*.log "$OUT"/r/backend_compile.log; do [ -f "$f" ] && { echo "== $f"; tail -40 "$f"; }; done
cat "$OUT/r/steps.txt"
tar -czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$OUT/r"

#!/usr/bin/env bash
# Every check that needs a CUDA GPU (a lent GPU machine's time is short): the CUDA tests,
# bench.inference and bench.train on the GPU (about 3 minutes with the machine's start), the app's
# pages on the GPU (bench.app_latency --device cuda) beside the whole suite with the app's model on
# the GPU (about 7 minutes more on an H100 machine's 16 cores: give the suite a call of its own).
# Each step's log goes to $OUT (default /tmp/cuda-checks); a step past its time limit is ended and
# the next one runs. Name steps to run only those.
#
#     bash bench/cuda.sh [cuda_tests] [inference] [train] [app_latency] [suite]
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/cuda-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

wanted=" ${*:-cuda_tests inference train app_latency suite} "
step() {  # step NAME SECONDS COMMAND...: the command's output to the screen and $out/NAME.log
    local name=$1 seconds=$2
    shift 2
    [[ $wanted == *" $name "* ]] || return 0
    echo "== $name (at most ${seconds} s)"
    local start=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    grep -E 'FAILED|ERROR|passed|failed|x$|images/s|ratio|MISSED' "$out/$name.log" | tail -n 60 || tail -n 40 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$python -c "import torch, torchvision, timm, transformers, streamlit; print('torch', torch.__version__,
'torchvision', torchvision.__version__, 'timm', timm.__version__, 'transformers', transformers.__version__,
'streamlit', streamlit.__version__, 'cuda', torch.cuda.is_available())"

step cuda_tests 150 $python -m pytest -q -p no:cacheprovider -rs \
    tests/analysis/test_analysis.py tests/data/test_data.py tests/cli/test_inspect.py tests/training/test_train.py tests/weights/test_weights.py -k cuda
step inference 60 $python -m bench.inference --device cuda --rounds 30
step train 120 $python -m bench.train --device cuda --batch-size 512 --rounds 15
# The app's pages on the GPU, beside the whole suite (its model on the GPU too: app.models.DEVICE);
# the browser, replicas and load tests need what this machine lacks and are left out.
step app_latency 200 $python -m bench.app_latency --device cuda --rounds 1 &
# Each worker at 2 threads (pytest-xdist is on the GPU image): with 12 workers of 16 threads each on
# 16 cores, two app tests' training runs (at nice 15) did not finish in time, likely starved.
OMP_NUM_THREADS=2 step suite 420 $python -m pytest -v -p no:cacheprovider -n 8 --timeout 200 --tb=short -rfE \
    --ignore tests/app/test_browser.py --ignore tests/serving/test_replicas.py --ignore tests/serving/test_class_load.py \
    --ignore tests/serving/test_app_load.py --ignore tests/serving/test_server_cpu.py --junitxml "$out/suite.xml"
wait

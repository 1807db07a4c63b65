# Everything runs inside .venv, created on first use from setup.cfg.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL := 3

.PHONY: install test demo samples lint bench bench-quick bench-real bench-real-share bench-speed bench-hybrid clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,plot,test]'
	touch $(STAMP)

# Two workers, a test file each at a time (its module fixtures made once): most tests wait on one
# core (a stand-in's server runs one thread), and the suite takes 9 to 15 minutes here (506 tests,
# stop 54: 11.4 on the final clean clone, alone; 11.9 with the install, and `make demo` 11 s).
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

demo: install
	mkdir -p out
	$(BIN)/lms analyze sample_graphs/unet3d.meta
	$(BIN)/lms rewrite sample_graphs/unet3d.meta out/unet3d.lms.meta --gpu-mem 75% --reserve 0 \
		--plan-out out/unet3d.plan.json --plot out/unet3d.png

samples: install
	$(BIN)/python sample_graphs/generate.py

lint: install
	$(BIN)/python -m pip install --quiet ruff
	$(BIN)/ruff check lmscli tests bench sample_graphs docs

bench: install
	$(BIN)/python bench/run.py
	$(MAKE) bench-speed
	$(MAKE) bench-hybrid

# tf-keras only for the benchmark's tf_keras graphs, and with --no-deps: its metadata asks for the
# full tensorflow wheel, which would replace tensorflow-cpu.
bench-speed: install
	$(BIN)/python -m pip install --quiet --no-deps tf-keras==2.21.0
	$(BIN)/python bench/floor.py
	$(BIN)/python bench/phases.py

bench-quick: install
	$(BIN)/python bench/run.py --quick

bench-real: install
	$(BIN)/python bench/realmem.py

bench-real-share: install
	$(BIN)/python bench/realmem.py --share

bench-hybrid: install
	$(BIN)/python bench/hybrid.py

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache

# make demo: install, convert the sample motions, train a short teacher and student on one clip (the pipeline end to
#            end), then evaluate and draw the shipped models (models/: CPU-scale, trained by this code on that clip).
# make test: install and run the test suite (what CI runs).
PYTHON ?= python3.11
PY := .venv/bin/python
TORCHRUN := OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2
CLIP := data/packets/g1_moves/M_ShortMove14_seg00.npz

.PHONY: demo test
demo: $(CLIP)
	$(TORCHRUN) teacher.py --preset cpu --motions $(CLIP) --total-env-steps 30720 --run-dir runs/demo_teacher
	$(TORCHRUN) student.py --preset cpu --teacher-ckpt runs/demo_teacher/teacher.pt --total-env-steps 30720 \
	    --run-dir runs/demo_student
	$(PY) evaluate.py --ckpt models/student.pt models/teacher.pt --labels student teacher --motions $(CLIP) \
	    --settings genesis_aligned genesis_aligned+dr --seeds 0 --episodes 16 --num-envs 16 --out-dir results/demo \
	    --render results/demo/student.gif
	@echo "demo done: runs/demo_teacher, runs/demo_student (30k steps: the pipeline runs; they fall), results/demo (the shipped models: table.md, student.gif)"

test: .venv/installed
	$(PY) -m pytest -q -p no:cacheprovider tests

.venv/installed: requirements.txt requirements-nodeps.txt constraints.txt
	$(PYTHON) -m venv .venv
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt
	$(PY) -m pip install -q --no-deps --ignore-requires-python -r requirements-nodeps.txt
	touch $@

$(CLIP): .venv/installed
	$(PY) ssjr.py convert data/samples/g1_moves --out data/packets/g1_moves
	$(PY) ssjr.py convert data/samples/cmu_bvh --out data/keypoints/cmu_bvh

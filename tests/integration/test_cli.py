import subprocess
import sys


def test_generate_answers_paris():
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "What is the capital of France?",
                        "--max-tokens", "32"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_bad_flag_value_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "Hi", "--temperature", "-1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2
    assert "temperature" in r.stderr

"""The code base's shape: comment density, one task plan, a short README, a code map that holds."""

import ast
import io
import pathlib
import re
import tokenize

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "petra_jax"


def _doc_and_comment_lines(src: str) -> set:
  lines = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT}
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.body[0] if node.body else None
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def test_docstrings_and_comments_are_at_most_a_quarter_of_the_package():
  doc = total = 0
  for path in PACKAGE.rglob("*.py"):
    src = path.read_text()
    doc += len(_doc_and_comment_lines(src))
    total += len(src.splitlines())
  assert doc <= 0.25 * total, f"{doc} of {total} lines are docstrings or comments"


def test_no_class_derives_from_pipeline():
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases]
        assert not any(b.split(".")[-1] == "Pipeline" for b in bases), (path, node.name)


def test_engine_holds_no_experiment_code():
  for path in (PACKAGE / "engine").rglob("*.py"):
    assert "hollow" not in path.read_text(), path


def test_readme_is_a_short_guide_and_the_code_map_names_every_engine_file():
  readme = (REPO / "README.md").read_text()
  code_map = (REPO / "docs" / "code.md").read_text()
  assert len(readme.splitlines()) <= 120
  named = set(re.findall(r"`([\w/]+\.py)`", readme + code_map))
  existing = {p.name for p in REPO.rglob("*.py")} | {
      str(p.relative_to(REPO)) for p in REPO.rglob("*.py")}
  assert named - existing == set(), "the README or docs/code.md names files that do not exist"
  links = {link.split("#")[0] for link in re.findall(r"\]\((docs/[^)]+)\)", readme)}
  assert {link for link in links if not (REPO / link).exists()} == set()
  assert "docs/code.md" in links
  engine = {p.name for p in (PACKAGE / "engine").rglob("*.py")} - {"__init__.py"}
  assert engine - named == set(), "engine files missing from docs/code.md's map"


def test_readme_gives_the_test_commands_ci_runs():
  ci = (REPO / ".ci" / "run").read_text()
  readme = (REPO / "README.md").read_text()
  commands = [line.strip() for line in ci.splitlines() if "python -m pytest" in line]
  assert len(commands) == 2 and all("--durations=25" in c for c in commands), commands
  for command in commands:
    assert command in readme, f"README.md does not give .ci/run's `{command}`"


def test_no_folder_holds_more_than_twelve_modules():
  folders = [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
  assert len(folders) > 10  # the walk found the sub-packages
  for folder in folders:
    modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 12, (folder, len(modules))


def test_no_project_module_is_imported_dynamically():
  """Every import of a petra_jax module is static, so import-linter sees every edge. The one
  dynamic import is of a user's ``MODULE:FUNCTION`` model (models/specs.py), not ours."""
  user_models = PACKAGE / "models" / "specs.py"
  for path in PACKAGE.rglob("*.py"):
    src = path.read_text()
    assert not re.search(r"(import_module|__import__)\(\s*f?[\"']petra_jax", src), path
    calls = [ast.unparse(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and ast.unparse(n.func).endswith(("import_module", "__import__"))]
    assert path == user_models or not calls, (path, calls)


def test_no_tracked_text_file_holds_a_merge_conflict():
  """A conflict left in a merge (``<<<<<<<`` .. ``>>>>>>>``) is caught here, not by a reader."""
  texts = [p for p in REPO.rglob("*") if p.suffix in {".py", ".md", ".toml", ".sh", ".txt", ".cfg"}
           and p.is_file() and not any(part.startswith((".venv", ".git")) or part == "runs"
                                       for part in p.relative_to(REPO).parts)]
  assert len(texts) > 50  # the walk found the project
  marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
  held = [str(p.relative_to(REPO)) for p in texts if marker.search(p.read_text(errors="ignore"))]
  assert not held, f"merge-conflict markers in {held}"

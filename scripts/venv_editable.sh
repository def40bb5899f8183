# Sourced by scripts/setup.sh (and its test): does a cached venv's editable pdxfer belong to a checkout?
# A venv in the shared cache serves every checkout of one stamp; the one set up last owns the editable
# install. The answer comes from Python's own import machinery in the venv (isolated, from /), so a
# checkout whose path is a suffix of another's (/work/main inside /check/work/main) is not taken for it.

# editable_points_here VENV DIR: true when `import pdxfer` in VENV loads DIR/pdxfer.
editable_points_here() {
  local venv=$1 dir=$2 found
  found=$(cd / && "$venv/bin/python" -I -c '
import importlib.util, os
spec = importlib.util.find_spec("pdxfer")
print(os.path.realpath(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else "")
' 2>/dev/null) || return 1
  [ -n "$found" ] && [ "$found" = "$(realpath -m "$dir/pdxfer")" ]
}

"""benchmarks/tuning/sass_diff.py's comparison of two commits' SASS listings."""

from benchmarks.tuning.sass_diff import compare


def _listing(*instructions: str) -> list[str]:
    """cuobjdump's layout: an offset, the instruction, its encoding."""
    return [
        f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000000000 */"
        for i, text in enumerate(instructions)
    ]


LOOP = ("MOV R1, c[0x0][0x28]", "FFMA R2, R3, R4, R2", "IADD3 R5, R5, 0x1, RZ", "BRA 0x10")


def test_compare_tells_same_code_argument_offsets_and_changes_apart():
    before = {
        "same": _listing(*LOOP),
        "offsets": _listing(*LOOP),
        "changed": _listing(*LOOP),
        "gone": _listing("EXIT"),
    }
    after = {
        "same": _listing(*LOOP),
        "offsets": _listing("MOV R1, c[0x0][0x30]", *LOOP[1:]),
        "changed": _listing(LOOP[0], "FMUL R2, R3, R4", *LOOP[2:]),
    }
    rows = {row.split(" | ")[0][2:]: row for row in compare(before, after).splitlines()[2:]}
    # launch | instructions before | after | loop before | after | loops alike | same code
    assert rows["same"].endswith("| 4 | 4 | 3 | 3 | yes | yes |")
    assert rows["offsets"].endswith("| yes | yes, but for argument offsets |")
    assert rows["changed"].endswith("| 3 | 3 | no | no (2 lines differ) |")
    assert rows["gone"].endswith("| one side only |")
    columns = compare(before, after).splitlines()[0].count("|")
    assert all(row.count("|") == columns for row in rows.values())

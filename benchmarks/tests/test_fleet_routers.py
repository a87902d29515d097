"""The fleet tables' page: each preset's block is rewritten alone."""

from benchmarks.fleet_routers import BEGIN, END, write_setup_block


def test_a_preset_block_is_rewritten_and_the_others_kept(tmp_path):
    page = tmp_path / "replicas.md"
    page.write_text(f"intro\n{BEGIN}\n{END}\nafter\n")
    write_setup_block(page, "fleet-a", ["### fleet-a", "old a", ""])
    write_setup_block(page, "fleet-b", ["### fleet-b", "b", ""])
    write_setup_block(page, "fleet-a", ["### fleet-a", "new a", ""])
    text = page.read_text()
    assert "old a" not in text and "new a" in text and "\nb\n" in text
    assert text.index("new a") < text.index("\nb\n") < text.index(END) < text.index("after")
    assert text.startswith(f"intro\n{BEGIN}\n<!-- fleet table fleet-a: begin -->")

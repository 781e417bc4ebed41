from .cli import main

main(prog_name="int4q")

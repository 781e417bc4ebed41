from quantizer.cli import (
    main,  # absolute: torchrun -m runs this file outside its package
)

main(prog_name="int4q")

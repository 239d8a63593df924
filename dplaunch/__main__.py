from dplaunch.cli import main

main()

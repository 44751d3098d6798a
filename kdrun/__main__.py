from kdrun.cli import main

main()

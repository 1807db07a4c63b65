from lmscli.cli import main

main()

from client.cli import main

main()

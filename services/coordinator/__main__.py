from services.coordinator.main import main

main()
